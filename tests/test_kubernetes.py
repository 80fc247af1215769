"""The `kubernetes` launcher's manifests, rendered from a launcher config the way a run renders them
(Dagster resource config -> plan -> ghostvis_core.launch.cluster.kubernetes_manifests) and validated offline against
the Kubernetes API schema (kubernetes-validate ships it). No cluster is needed."""

from __future__ import annotations

import json
import re
import threading
import time
from io import StringIO
from types import SimpleNamespace

import kubernetes
import kubernetes_validate
import pytest
from dagster import DagsterInstance, Failure, MaterializeResult, asset, build_resources, materialize
from dagster_k8s.pipes import build_pod_body
from dagster_pipes import decode_env_var

from ghostvis_core.home import Home
from ghostvis_core.launch.cluster.kubernetes_manifests import (
    CONTAINER,
    INDEX_ANNOTATION,
    JOB_LABEL,
    NAME_MAX,
    QUEUE_LABEL,
    render_indexed_job,
    render_pod,
    resource_name,
)
from ghostvis_core.plan.presets import resolve
from ghostvis_core.run.track.pipes import StoreMessageWriterChannel
from ghostvis_core.run.train.watchdog import Watchdog
from ghostvis_core.runs.file_uri import read_run_file
from ghostvis_core.runs.job_command import Job
from ghostvis_core.runs.launch_spec import LaunchSpec
from ghostvis_core.verify.eval.eval_spec import EvalSpec, eval_job
from ghostvis_pipeline.launchers import Launcher
from ghostvis_pipeline.launchers import kubernetes as k8s_launcher
from ghostvis_pipeline.launchers.common import registration_job, training_job
from ghostvis_pipeline.launchers.kubernetes import plan
from tests.launch_records import launch_record

K8S = "1.33.0"  # the cluster version the manifests are checked against (strict: no unknown fields)
SECRET_VALUE = "do-not-leak-8b1f"  # a credential in the Dagster host's environment
CLUSTER = {
    "image": "registry.example.com/ghostvis:0.1.0",
    "gpus_per_node": 8,
    "cpu": 64,
    "memory": "900Gi",
    "namespace": "ml-training",
    "store_claim": "ghostvis-store",
    "secrets": ["ghostvis-s3", "mlflow-auth"],
    "env": {"NCCL_DEBUG": "WARN"},
    "queue": "h100",
    "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
    "service_account": "ghostvis-trainer",
    "image_pull_secrets": ["registry-creds"],
}


def launcher(**kubernetes_config) -> Launcher:
    """The launcher resource built by Dagster from run config, as a materialization gets it."""
    config = {"kind": "kubernetes", "profile": "no-infiniband", "kubernetes": kubernetes_config}
    with build_resources(
        {"launcher": Launcher.configure_at_launch()}, resource_config={"launcher": {"config": config}}
    ) as resources:
        return resources.launcher


def pretrain_spec(
    world_size: int,
    run_key: str = "pretrain-3f9c2a1b7d-r1",
    mlflow: str = "http://mlflow.ml-training.svc:5000",
    hang_timeout_s: float = 600.0,
) -> LaunchSpec:
    config = resolve("pretrain", "smoke", {"batch.world_size": world_size, "runtime.hang_timeout_s": hang_timeout_s})
    return launch_record(
        "pretrain", run_key, config, None, store="", mlflow_tracking_uri=mlflow, mlflow_artifact_location=""
    )


def launch_spec(world_size: int, **spec) -> Job:
    """A pretrain run's training job, as the stage asset hands it to the launcher."""
    return training_job(pretrain_spec(world_size, **spec))


@pytest.fixture
def home(tmp_path, monkeypatch) -> Home:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_VALUE)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", SECRET_VALUE)
    monkeypatch.delenv("GHOSTVIS_STORE", raising=False)  # the store is a folder in the home
    return Home(tmp_path / "home")


def validate(manifest: dict) -> None:
    kubernetes_validate.validate(manifest, K8S, strict=True)


def container(pod_spec: dict) -> dict:
    (only,) = pod_spec["containers"]
    assert only["name"] == CONTAINER
    return only


def env_of(c: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


def test_one_node_is_one_pod_with_all_its_gpus(home):
    job, run = plan(launcher(**CLUSTER), launch_spec(world_size=8), home)
    meta, spec = render_pod(job, run)
    validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "trainer-0", **meta}, "spec": spec})
    c = container(spec)
    assert c["command"] == [
        "python",
        "-m",
        "ghostvis_core.run.elastic_agent",
        "--standalone",
        "--nproc_per_node=8",
        "--signals-to-handle=SIGTERM,SIGINT,SIGUSR1,SIGUSR2",
        "--shutdown-timeout=120",
        "-m",
        "ghostvis_core.run",
        "--spec",
        home.store.uri_of("run_spec", "pretrain", run.run_key),
    ]
    assert c["resources"]["limits"] == {"cpu": "64", "memory": "900Gi", "nvidia.com/gpu": "8"}
    assert c["resources"]["requests"] == c["resources"]["limits"]
    assert meta["labels"][QUEUE_LABEL] == "h100"
    assert {"name": "store", "mountPath": str(home.root / "store")} in c["volumeMounts"]
    assert {"name": "store", "persistentVolumeClaim": {"claimName": "ghostvis-store"}} in spec["volumes"]
    assert {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}} in spec["volumes"]
    assert c["envFrom"] == [{"secretRef": {"name": "ghostvis-s3"}}, {"secretRef": {"name": "mlflow-auth"}}]
    env = env_of(c)
    assert env["NCCL_IB_DISABLE"] == "1" and env["NCCL_DEBUG"] == "WARN" and env["OMP_NUM_THREADS"] == "8"
    assert spec["restartPolicy"] == "Never" and spec["serviceAccountName"] == "ghostvis-trainer"
    assert spec["terminationGracePeriodSeconds"] == 130  # runtime.preempt_grace_s (120) and torchrun's exit (10)
    assert SECRET_VALUE not in json.dumps([meta, spec])


def test_one_node_pod_is_what_dagster_k8s_pipes_submits(home):
    """PipesK8sClient merges base_pod_meta / base_pod_spec with its own name and Pipes environment:
    the Pod it would create is valid too, and still ours."""
    job, run = plan(launcher(**CLUSTER), launch_spec(world_size=8), home)
    meta, spec = render_pod(job, run)
    pipes_env = {"DAGSTER_PIPES_CONTEXT": "e30=", "DAGSTER_PIPES_MESSAGES": "e30="}
    body = build_pod_body(
        pod_name="dagster-run-pretrain-0123456789",
        image=None,
        command=None,
        env_vars=pipes_env,
        base_pod_meta=meta,
        base_pod_spec=spec,
    )
    pod = {"apiVersion": "v1", "kind": "Pod", **kubernetes.client.ApiClient().sanitize_for_serialization(body)}
    validate(pod)
    c = container(pod["spec"])
    assert c["image"] == CLUSTER["image"] and c["command"] == container(spec)["command"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert env_of(c)["DAGSTER_PIPES_CONTEXT"] == "e30=" and env_of(c)["NCCL_IB_DISABLE"] == "1"
    assert pod["metadata"]["labels"][QUEUE_LABEL] == "h100"
    assert pod["spec"]["volumes"] == spec["volumes"]


def eval_target(mlflow: str = "http://mlflow.ml-training.svc:5000") -> Job:
    """The evaluation job of a three-stage lineage, as the evaluation asset hands it to the launcher."""
    lineage = {"pretrain": "pretrain-1-r1", "sft": "sft-2-r1", "dpo": "dpo-3-r1"}
    return eval_job(EvalSpec("ev1d", "", mlflow, "tok", lineage, {}, ["ghostvis_capitals"], []))


def test_the_evaluation_and_registration_jobs_are_one_pod_of_one_rank_on_a_four_node_launcher(home):
    """The launcher's nodes are training's: a one-rank job (the evaluation, a cache hit's registration) is one
    pod whatever they are, its command the job's module on its spec in the store, rendered as training's is."""
    resource = launcher(**{**CLUSTER, "nodes": 4})
    job, run = plan(resource, eval_target(), home)
    assert (job.nodes, job.gpus_per_node, run.nproc_per_node) == (1, 1, 1)
    meta, spec = render_pod(job, run)
    validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "evaluation-0", **meta}, "spec": spec})
    assert container(spec)["command"] == [
        *["python", "-m", "ghostvis_core.run.elastic_agent", "--standalone", "--nproc_per_node=1"],
        *["--signals-to-handle=SIGTERM,SIGINT,SIGUSR1,SIGUSR2", "--shutdown-timeout=120"],
        *["-m", "ghostvis_core.verify.eval", "--spec", home.store.uri_of("run_spec", "evaluation", "ev1d")],
    ]
    assert env_of(container(spec))["OMP_NUM_THREADS"] == "64"  # the pod's cores, for the stages scored side by side
    registering = registration_job(pretrain_spec(world_size=32), "http://mlflow.ml-training.svc:5000")
    job, run = plan(resource, registering, home)
    assert container(render_pod(job, run)[1])["command"][-5:] == [
        "ghostvis_core.run.hf.register",
        "--spec",
        home.store.uri_of("run_spec", "pretrain", "pretrain-3f9c2a1b7d-r1"),
        "--tracking-uri",
        "http://mlflow.ml-training.svc:5000",
    ]


def test_four_nodes_are_an_indexed_job_behind_a_headless_service(home):
    job, run = plan(launcher(**{**CLUSTER, "nodes": 4}), launch_spec(world_size=32), home)
    service, manifest = render_indexed_job(job, run)
    validate(service)
    validate(manifest)
    name = manifest["metadata"]["name"]
    assert service["metadata"]["name"] == name and service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {JOB_LABEL: name} and service["spec"]["publishNotReadyAddresses"]
    spec = manifest["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 4
    assert spec["backoffLimit"] == 0 and spec["suspend"] is True  # Kueue admits it
    assert manifest["metadata"]["labels"][QUEUE_LABEL] == "h100"
    template = spec["template"]
    assert template["metadata"]["labels"][JOB_LABEL] == name and QUEUE_LABEL not in template["metadata"]["labels"]
    pod = template["spec"]
    assert pod["subdomain"] == name and pod["restartPolicy"] == "Never"
    c = container(pod)
    cmd = c["command"]
    assert f"--rdzv-endpoint={name}-0.{name}:29400" in cmd and "--rdzv-backend=c10d" in cmd
    assert "--nnodes=4" in cmd and "--nproc_per_node=8" in cmd and f"--rdzv-id={run.run_key}" in cmd
    assert not [arg for arg in cmd if arg.startswith("--node-rank")]  # c10d ignores it: nodes are sorted
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert {"name": "store", "mountPath": str(home.root / "store")} in c["volumeMounts"]
    assert [r["action"] for r in spec["podFailurePolicy"]["rules"]] == ["Ignore", "FailJob"]
    assert c["envFrom"] == [{"secretRef": {"name": "ghostvis-s3"}}, {"secretRef": {"name": "mlflow-auth"}}]
    assert SECRET_VALUE not in json.dumps([service, manifest])


def test_the_stage_grace_period_is_the_pods_and_torchruns(home):
    """runtime.preempt_grace_s of the stage sets both torchrun's wait for its ranks and the pods' grace (that wait
    plus torchrun's exit), on every pod of a multi-node Job."""
    config = resolve("pretrain", "smoke", {"batch.world_size": 32, "runtime.preempt_grace_s": 300})
    spec = launch_record("pretrain", "pretrain-g-r1", config, None, store="", mlflow_tracking_uri="http://m:5000")
    job, run = plan(launcher(**{**CLUSTER, "nodes": 4}), training_job(spec), home)
    pod = render_indexed_job(job, run)[1]["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 310
    assert "--shutdown-timeout=300" in container(pod)["command"]


def test_with_an_s3_store_the_pods_need_no_claim(home, tmp_path, monkeypatch):
    """The store in a bucket: the spec is an s3:// URI, credentials come from the listed Secrets."""
    monkeypatch.setenv("GHOSTVIS_STORE", "s3://ghostvis-runs/store")
    monkeypatch.setenv("GHOSTVIS_STORE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    job, run = plan(launcher(**{**CLUSTER, "store_claim": "", "nodes": 4}), launch_spec(world_size=32), home)
    service, manifest = render_indexed_job(job, run)
    validate(manifest)
    pod = manifest["spec"]["template"]["spec"]
    assert [v["name"] for v in pod["volumes"]] == ["shm"]
    assert container(pod)["command"][-2:] == [
        "--spec",
        f"s3://ghostvis-runs/store/runs/pretrain/{run.run_key}/spec.json",
    ]
    assert SECRET_VALUE not in json.dumps([service, manifest])


@pytest.mark.parametrize(
    "break_it",
    [
        lambda m: m["spec"]["template"]["spec"].update(nodeSelecter={"a": "b"}),  # misspelled key
        lambda m: m["spec"].update(completions="4"),  # wrong type
        lambda m: m["spec"]["template"]["spec"]["containers"][0].update(envFrom=[{"secretRef": "ghostvis-s3"}]),
    ],
)
def test_schema_catches_a_wrong_field(home, break_it):
    job, run = plan(launcher(**{**CLUSTER, "nodes": 4}), launch_spec(world_size=32), home)
    _, manifest = render_indexed_job(job, run)
    break_it(manifest)
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(manifest)


@pytest.mark.parametrize("run_key", ["pretrain@lr-high-3f9c2a1b7d-r2", "pretrain-" + "9" * 80 + "-r12"])
def test_names_are_dns_labels_and_distinct(run_key):
    name = resource_name("continued_pretrain", run_key)
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= NAME_MAX
    assert name != resource_name("continued_pretrain", run_key + "x")
    assert resource_name("pretrain", "pretrain-3f9c2a1b7d-r1") == "gv-pretrain-pretrain-3f9c2a1b7d-r1"


@pytest.mark.parametrize(
    "config, spec, fix",
    [
        ({**CLUSTER, "image": ""}, launch_spec(8), "kubernetes.image"),
        ({**CLUSTER, "nodes": 0}, launch_spec(8), "kubernetes.nodes=0"),
        ({**CLUSTER, "store_claim": ""}, launch_spec(8), "store_claim"),
        ({**CLUSTER, "gpus_per_node": 4}, launch_spec(8), "gpus_per_node"),
        ({**CLUSTER, "nodes": 4}, launch_spec(8), "batch.world_size=32"),  # 2 ranks on 8 GPUs a node
        ({**CLUSTER, "nodes": 3}, launch_spec(32), "batch.world_size"),  # 32 ranks do not split in 3
        (CLUSTER, launch_spec(8, mlflow="sqlite:///home/mlflow.db"), "MLFLOW_TRACKING_URI"),
    ],
)
def test_a_config_the_run_cannot_use_fails_before_the_cluster(home, config, spec, fix):
    with pytest.raises(Failure, match=re.escape(fix)):
        plan(launcher(**config), spec, home)


class FakeCluster:
    """The Kubernetes API calls of a multi-node launch, answered in memory: the Job runs for two
    polls (pod 0 prints two lines, rank 0 sends a Pipes log message through the store), then ends
    with `outcome`."""

    def __init__(self, home: Home, spec: Job, outcome: str = "Complete", freeze_after: int = 0):
        self.home, self.spec, self.outcome = home, spec, outcome
        # > 0: the job's two ranks beat during that many polls, then their node freezes (the Job never ends)
        self.freeze_after = freeze_after
        self.dogs = [Watchdog(home.store, spec.stage, spec.run_key, r, 2, spec.runtime.hang_timeout_s) for r in (0, 1)]
        self.last_beat = self.deleted_at = None  # time.monotonic() of the ranks' last heartbeat, of the Job's deletion
        self.objects: dict[tuple[str, str], dict] = {}
        self.created: list[str] = []
        self.polls = 0

    def _create(self, kind: str, body: dict) -> None:
        key = (kind, body["metadata"]["name"])
        if key in self.objects:
            raise kubernetes.client.ApiException(status=409, reason="AlreadyExists")
        self.objects[key] = body
        self.created.append(kind)

    def create_namespaced_service(self, namespace, body):
        self._create("Service", body)

    def create_namespaced_job(self, namespace, body):
        self._create("Job", body)
        env = {e["name"]: e.get("value") for e in body["spec"]["template"]["spec"]["containers"][0]["env"]}
        channel = StoreMessageWriterChannel(decode_env_var(env["DAGSTER_PIPES_MESSAGES"]), interval=1)
        channel.upload_messages_chunk(
            StringIO(
                json.dumps(
                    {  # rank 0's first chunk, through the store
                        "__dagster_pipes_version": "0.1",
                        "method": "log",
                        "params": {"message": "rank 0 reporting", "level": "INFO"},
                    }
                )
            ),
            1,
        )
        if self.outcome == "Complete":
            self.home.store.write_json("run_record", self.spec.stage, self.spec.run_key, data={})

    def read_namespaced_job(self, name, namespace):
        if ("Job", name) not in self.objects:
            raise kubernetes.client.ApiException(status=404, reason="NotFound")
        self.polls += 1
        if self.polls <= self.freeze_after:
            for dog in self.dogs:
                dog.progress(self.polls)
                dog.beat()
            self.last_beat = time.monotonic()
        message = "pod 2 exited 1" if not self.freeze_after else "nothing ended the frozen job in 2000 polls"
        done = [SimpleNamespace(type=self.outcome, status="True", message=message, reason="")]
        ends = self.polls > (2000 if self.freeze_after else 2)
        status = SimpleNamespace(conditions=done if ends else [], active=4, ready=4, succeeded=0, failed=0)
        return SimpleNamespace(spec=SimpleNamespace(suspend=self.polls == 1, completions=4), status=status)

    def list_namespaced_pod(self, namespace, label_selector):
        name = label_selector.split("=")[1]
        pods = [
            SimpleNamespace(
                metadata=SimpleNamespace(name=f"{name}-{i}-x7k2p", annotations={INDEX_ANNOTATION: str(i)}),
                status=SimpleNamespace(phase="Running"),
            )
            for i in range(4)
        ]
        return SimpleNamespace(items=pods)

    def read_namespaced_pod_log(self, pod, namespace, **kwargs):
        assert pod.endswith("-0-x7k2p") and kwargs["container"] == CONTAINER and kwargs["follow"]
        return iter([b"step 1 loss 3.21\n", b"step 2 loss 3.05\n"])

    def delete_namespaced_job(self, name, namespace, body):
        del self.objects[("Job", name)]
        self.deleted_at = time.monotonic()

    def delete_namespaced_service(self, name, namespace, body):
        del self.objects[("Service", name)]


def launch_on(cluster: FakeCluster, home: Home, spec: Job, monkeypatch):
    """Materialize an asset whose body is the kubernetes launcher, against the fake cluster."""
    monkeypatch.setattr(k8s_launcher, "_clients", lambda: (cluster, cluster))
    monkeypatch.setattr(k8s_launcher, "POLL_SECONDS", 0.01)
    resource = launcher(**{**CLUSTER, "nodes": 4})

    @asset
    def pretrain(context):
        k8s_launcher.run_kubernetes(context, spec, home, resource)
        return MaterializeResult()

    instance = DagsterInstance.ephemeral()
    result = materialize([pretrain], instance=instance, raise_on_error=False)
    failures = [e.step_failure_data.error.message for e in result.get_step_failure_events()]
    return result, [e.user_message for e in instance.all_logs(result.run_id)] + failures


def test_a_multi_node_launch_is_followed_and_cleaned_up(home, monkeypatch):
    spec = launch_spec(world_size=32)
    cluster = FakeCluster(home, spec)
    result, logs = launch_on(cluster, home, spec, monkeypatch)
    assert result.success
    assert cluster.created == ["Service", "Job"] and cluster.objects == {}  # both deleted
    assert any("waiting in Kueue" in m for m in logs) and any("step 2 loss 3.05" in m for m in logs)
    assert "rank 0 reporting" in logs  # Pipes, through the store
    [told] = [m for m in logs if "kubectl apply -f -" in m]  # the manifests, by their store URI
    uri = re.search(r"`ghostvis store cat (\S+) \| kubectl apply -f -`", told)[1]
    assert [o["kind"] for o in json.loads(read_run_file(uri))["items"]] == ["Service", "Job"]


def test_a_failed_job_fails_the_run_and_is_cleaned_up(home, monkeypatch):
    spec = launch_spec(world_size=32)
    cluster = FakeCluster(home, spec, outcome="Failed")
    result, logs = launch_on(cluster, home, spec, monkeypatch)
    assert not result.success and cluster.objects == {}
    assert any("failed: pod 2 exited 1" in m for m in logs)


FROZEN = (
    r"hung: no heartbeat of run pretrain-3f9c2a1b7d-r1 moved for \d s \(runtime.hang_timeout_s=0.8\): node "
    r"{host} \(ranks 0, 1, last step reported {step}, in between steps\) froze with torchrun and every rank "
    r"stopped \(a paused VM, a stalled kernel\), where no rank can report; the launcher ended the job; the stage's "
    r"retry resumes from the newest checkpoint"
)


def test_a_frozen_multi_node_job_is_deleted_and_its_run_fails_for_a_retry_naming_the_node(home, monkeypatch):
    """The pods' ranks beat during 5 polls, then their node freezes (the Job stays active): the launching side's
    watch ends the launch within the hang timeout, naming the node and the last step, deletes the Job and its
    Service, and leaves the run to the stage's retry."""
    spec = launch_spec(world_size=32, hang_timeout_s=0.8)
    cluster = FakeCluster(home, spec, outcome="Failed", freeze_after=5)
    result, logs = launch_on(cluster, home, spec, monkeypatch)
    assert not result.success and cluster.objects == {}
    assert 0.8 <= cluster.deleted_at - cluster.last_beat <= 0.8 + 3.0  # the timeout, a read's interval, a poll
    (failed,) = result.get_step_failure_events()
    told = failed.step_failure_data.error.message
    frozen = FROZEN.format(host=re.escape(cluster.dogs[0].host), step=5)
    assert re.search(frozen + rf"; Kubernetes Job ml-training/{resource_name(spec.stage, spec.run_key)} deleted", told)
    assert failed.step_failure_data.user_failure_data.metadata.get("cancelled").value is False  # a fault: retried


def test_a_frozen_one_node_pod_is_deleted_and_its_run_fails_for_a_retry_naming_the_node(home, monkeypatch):
    """One pod through dagster-k8s Pipes, whose wait the launcher cannot poll from: its ranks beat three times, then
    the node freezes; the launcher's watch thread deletes the pod by its launch label (dagster-k8s's wait then
    ends, as it does for a pod deleted under it) and the launch fails naming the node and the last step."""
    spec = launch_spec(world_size=8, hang_timeout_s=0.8)
    dogs = [Watchdog(home.store, spec.stage, spec.run_key, r, 2, 0.8) for r in (0, 1)]
    deleted = threading.Event()
    label = f"{JOB_LABEL}={resource_name(spec.stage, spec.run_key)}"

    class Core:  # the pod API calls of the watch's deletion
        def list_namespaced_pod(self, namespace, label_selector):
            assert (namespace, label_selector) == ("ml-training", label)
            return SimpleNamespace(items=[SimpleNamespace(metadata=SimpleNamespace(name="dagster-1a2b-pretrain-7"))])

        def delete_namespaced_pod(self, name, namespace, grace_period_seconds):
            assert (name, namespace, grace_period_seconds) == ("dagster-1a2b-pretrain-7", "ml-training", 0)
            deleted.set()

    class FrozenPipesK8sClient:  # the pod's ranks beat, freeze, and the wait ends once the pod is deleted
        def run(self, **kwargs):
            for step in (1, 2, 3):
                for dog in dogs:
                    dog.progress(step)
                    dog.beat()
                time.sleep(0.1)
            assert deleted.wait(timeout=30)
            raise RuntimeError("Pod dagster-1a2b-pretrain-7 was deleted\n<the pod's manifest>")

    import dagster_k8s

    monkeypatch.setattr(dagster_k8s, "PipesK8sClient", FrozenPipesK8sClient)
    monkeypatch.setattr(k8s_launcher, "_clients", lambda: (Core(), None))
    monkeypatch.setattr(k8s_launcher, "POLL_SECONDS", 0.01)
    resource = launcher(**CLUSTER)

    @asset
    def pretrain(context):
        k8s_launcher.run_kubernetes(context, spec, home, resource)
        return MaterializeResult()

    result = materialize([pretrain], raise_on_error=False)
    (failed,) = result.get_step_failure_events()
    assert deleted.is_set()
    frozen = FROZEN.format(host=re.escape(dogs[0].host), step=3)
    assert re.search(frozen + "; its pod was deleted", failed.step_failure_data.error.message)


def test_a_left_over_job_is_named_and_left_alone(home, monkeypatch):
    spec = launch_spec(world_size=32)
    cluster = FakeCluster(home, spec)
    name = resource_name(spec.stage, spec.run_key)
    cluster.objects[("Job", name)] = {"metadata": {"name": name}}
    result, logs = launch_on(cluster, home, spec, monkeypatch)
    assert not result.success and list(cluster.objects) == [("Job", name)]  # ours deleted, theirs kept
    assert any(f"kubectl -n ml-training get job {name}" in m for m in logs)


def test_a_one_node_launch_goes_through_dagster_k8s_pipes(home, monkeypatch):
    spec = launch_spec(world_size=8)
    calls = []

    class FakePipesK8sClient:  # what the launcher hands dagster-k8s; the pod "trains" and leaves its record
        def run(self, **kwargs):
            calls.append(kwargs)
            home.store.write_json("run_record", spec.stage, spec.run_key, data={})

    import dagster_k8s  # the launcher imports its client on use

    monkeypatch.setattr(dagster_k8s, "PipesK8sClient", FakePipesK8sClient)
    resource = launcher(**CLUSTER)

    @asset
    def pretrain(context):
        k8s_launcher.run_kubernetes(context, spec, home, resource)
        return MaterializeResult()

    assert materialize([pretrain]).success
    (call,) = calls
    job, run = plan(resource, spec, home)
    assert (call["base_pod_meta"], call["base_pod_spec"]) == render_pod(job, run)
    assert call["namespace"] == "ml-training" and call["pod_wait_timeout"] == 0  # no 24-hour limit on training

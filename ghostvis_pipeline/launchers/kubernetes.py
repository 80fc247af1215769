"""The `kubernetes` launcher: the run's nodes as pods, through Dagster Pipes.

One node: one pod submitted by dagster-k8s (`PipesK8sClient`), whose messages come back in the pod's
logs. Several nodes: a headless Service and an Indexed Job created here; rank 0's messages travel
through the shared store (any rank may be rank 0), pod 0's logs are streamed into the run's log,
and the Job and Service are deleted however the run ends. Manifests:
ghostvis_core/launch/cluster/kubernetes_manifests.py.

Either way the launching side watches the ranks' heartbeats (launchers/common.py frozen_watch): when none moves for
runtime.hang_timeout_s (a frozen node, where no rank can report), the run's pods are deleted and the launch fails
naming the node and the last step, for the stage's retry to resume from the newest checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
import urllib.parse
from collections.abc import Callable

from dagster import AssetExecutionContext, Failure

from ghostvis_core.errors import GhostvisError
from ghostvis_core.home import Home
from ghostvis_core.launch.cluster.kubernetes_manifests import (
    CONTAINER,
    INDEX_ANNOTATION,
    JOB_LABEL,
    KubernetesJob,
    RunTarget,
    check_config,
    check_job,
    render_indexed_job,
    render_pod,
)
from ghostvis_core.runs.job_command import Job
from ghostvis_pipeline.config import config_from_dataclass
from ghostvis_pipeline.launchers.common import clear_reason, failure, frozen_watch, job_env, require_result, spec_uri
from ghostvis_pipeline.launchers.pipes import store_pipes_session
from ghostvis_pipeline.launchers.processes import Frozen

KubernetesConfig = config_from_dataclass(KubernetesJob)
POLL_SECONDS = 10.0
DELETE_WAIT_SECONDS = 120.0  # a retry must not start while the last attempt's pods still write


def plan(launcher, target: Job, home: Home) -> tuple[KubernetesJob, RunTarget]:
    """The pods' config and what they run, checked before anything reaches the cluster."""
    job = KubernetesJob(**launcher.sized(launcher.kubernetes, target))
    try:
        check_config(job)
        nproc = launcher.ranks_per_node(target)
        run = RunTarget(
            stage=target.stage,
            run_key=target.run_key,
            spec_uri=spec_uri(home, target),
            store_path=store_folder(home),
            nproc_per_node=nproc,
            env=job_env(launcher.profile, nproc, job.cpu),
            module=target.module,
            args=target.args,
            grace_s=target.runtime.preempt_grace_s,
        )
        check_job(job, run)
    except GhostvisError as exc:
        raise Failure(str(exc), allow_retries=False) from None
    if not job.store_claim and run.store_path:
        raise Failure(
            f"launcher kubernetes.store_claim is empty: pods cannot see the store folder "
            f"{run.store_path}; set store_claim to a ReadWriteMany PVC that the Dagster host mounts "
            "there, or use an S3 store (docs/launch-kubernetes.md)",
            allow_retries=False,
        )
    if target.mlflow_tracking_uri.startswith(("sqlite:", "file:", "/", ".")):
        raise Failure(
            f"MLflow tracking URI {target.mlflow_tracking_uri} is a file on the Dagster host that pods "
            "cannot reach: run a tracking server and set MLFLOW_TRACKING_URI=http(s)://... where "
            "Dagster runs",
            allow_retries=False,
        )
    return job, run


def store_folder(home: Home) -> str:
    """The store's folder on the Dagster host, where the pods mount store_claim; "" for a bucket store,
    which the pods reach by its URI."""
    parsed = urllib.parse.urlparse(home.store.uri)
    return urllib.parse.unquote(parsed.path) if parsed.scheme == "file" else ""


def run_kubernetes(context: AssetExecutionContext, target: Job, home: Home, launcher) -> None:
    job, run = plan(launcher, target, home)
    clear_reason(home, target)
    try:
        if job.nodes == 1:
            _run_pod(context, target, home, job, run)
        else:
            _run_indexed_job(context, target, home, job, run)
    except Frozen as exc:  # its pods are deleted: the stage's retry resumes from the newest checkpoint
        raise failure(home, target, str(exc)) from None
    require_result(home, target)


def _run_pod(context: AssetExecutionContext, target: Job, home: Home, job: KubernetesJob, run: RunTarget) -> None:
    """One pod through dagster-k8s Pipes; it deletes the pod when the run ends, however it ends. Meanwhile a thread
    watches the heartbeats: a frozen job's pod is deleted (dagster-k8s's wait then ends), raised as `Frozen`."""
    meta, pod = render_pod(job, run)
    context.log.info(f"launching a pod in namespace {job.namespace}: {' '.join(pod['containers'][0]['command'])}")
    from dagster_k8s import PipesK8sClient  # imported on use: the client libraries are slow to import

    name = meta["labels"][JOB_LABEL]
    watch = FrozenPods(frozen_watch(home, target), lambda: _delete_pods(context, job.namespace, name))
    try:
        # pod_wait_timeout=0: no limit on a training run's length (dagster-k8s would stop at 24 hours)
        PipesK8sClient().run(
            context=context, namespace=job.namespace, base_pod_meta=meta, base_pod_spec=pod, pod_wait_timeout=0
        )
    except Exception as exc:
        watch.stop()  # a deletion in progress ends first
        watch.raise_if_frozen()
        first_line = (str(exc).splitlines() or [type(exc).__name__])[0]  # dagster-k8s appends the whole pod
        raise failure(home, target, f"pod in namespace {job.namespace}: {first_line}") from None
    finally:
        watch.stop()
    watch.raise_if_frozen()


class FrozenPods:
    """A thread polling `frozen` (the launching side's heartbeat watch) every POLL_SECONDS while a launch waits in a
    call it cannot poll from (dagster-k8s's wait for its pod); once frozen, it calls `end` (deleting the pods: it
    returns what it did) once and keeps the reason and that for `raise_if_frozen`."""

    def __init__(self, frozen: Callable[[], str | None], end: Callable[[], str]):
        self.frozen, self.end, self.reason = frozen, end, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ghostvis-frozen-pods", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            reason = self.frozen()
            if reason:
                self.reason = f"{reason}; {self.end()}"
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def raise_if_frozen(self) -> None:
        if self.reason:
            raise Frozen(self.reason)


def _delete_pods(context: AssetExecutionContext, namespace: str, name: str) -> str:
    """Delete the pods of launch `name` (label JOB_LABEL) at once (a frozen node would not stop within a grace):
    what was done, for the launch's failure."""
    try:
        core, _ = _clients()
        pods = core.list_namespaced_pod(namespace, label_selector=f"{JOB_LABEL}={name}").items
        for pod in pods:
            context.log.warning(f"deleting pod {namespace}/{pod.metadata.name}: its job froze")
            core.delete_namespaced_pod(pod.metadata.name, namespace, grace_period_seconds=0)
    except Exception as exc:
        return (
            f"its pod could not be deleted ({type(exc).__name__}: {exc}): delete it with `kubectl -n {namespace} "
            f"delete pod -l {JOB_LABEL}={name}`"
        )
    return "its pod was deleted"


def _run_indexed_job(
    context: AssetExecutionContext, target: Job, home: Home, job: KubernetesJob, run: RunTarget
) -> None:
    core, batch = _clients()
    created: list[str] = []
    with store_pipes_session(context, home, target, context.run.run_id) as session:
        run = dataclasses.replace(run, env={**run.env, **session.get_bootstrap_env_vars()})
        service, manifest = render_indexed_job(job, run)
        name = manifest["metadata"]["name"]
        command = " ".join(manifest["spec"]["template"]["spec"]["containers"][0]["command"])
        uri = home.store.write_json(
            "run_file",
            target.stage,
            target.run_key,
            f"kubernetes/{context.run.run_id}.json",
            data={"apiVersion": "v1", "kind": "List", "items": [service, manifest]},
        )
        context.log.info(
            f"launching Indexed Job {job.namespace}/{name}, {job.nodes} pods: {command}; its "
            f"Service and Job: {uri} (`ghostvis store cat {uri} | kubectl apply -f -`)"
        )
        try:
            _create(core.create_namespaced_service, job.namespace, service, created)
            _create(batch.create_namespaced_job, job.namespace, manifest, created)
            state, message = _follow(context, core, batch, job.namespace, name, frozen_watch(home, target))
        except Frozen as exc:  # deleted in `finally`, before the stage's retry launches again
            raise Frozen(f"{exc}; Kubernetes Job {job.namespace}/{name} deleted") from None
        finally:
            _delete(context, core, batch, job.namespace, name, created)
    if state != "Complete":
        raise failure(home, target, f"Kubernetes Job {job.namespace}/{name} failed: {message}")


def _clients() -> tuple:
    """In a pod: its service account; elsewhere: the kubeconfig (as dagster-k8s Pipes does)."""
    import kubernetes

    try:
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            kubernetes.config.load_incluster_config()
        else:
            kubernetes.config.load_kube_config()
    except kubernetes.config.ConfigException as exc:
        raise Failure(
            f"no Kubernetes credentials ({exc}): run Dagster in the cluster under a service account, "
            "or give it a kubeconfig (KUBECONFIG)",
            allow_retries=False,
        ) from None
    return kubernetes.client.CoreV1Api(), kubernetes.client.BatchV1Api()


def _create(create, namespace: str, manifest: dict, created: list[str]) -> None:
    """Create one object; remember it so that only what this launch made is deleted."""
    from kubernetes.client.exceptions import ApiException

    kind, name = manifest["kind"], manifest["metadata"]["name"]
    try:
        create(namespace, manifest)
    except ApiException as exc:
        fix = {
            409: f"an earlier launch of this run left it behind or still runs it: inspect it with `kubectl "
            f"-n {namespace} get {kind.lower()} {name}` and delete it before retrying",
            403: f"the Dagster process's account may not create {kind}s in namespace {namespace}: grant it "
            "the Role in docs/launch-kubernetes.md",
        }.get(exc.status, _api_message(exc))
        raise Failure(
            f"Kubernetes {kind} {namespace}/{name}: {exc.status}: {fix}", allow_retries=exc.status not in (403, 409)
        ) from None
    created.append(kind)


def _api_message(exc) -> str:
    """The API server's own explanation (which field is invalid, which quota is exceeded)."""
    try:
        return json.loads(exc.body or "{}").get("message") or str(exc.reason)
    except (ValueError, AttributeError):
        return str(exc.reason)


def _follow(
    context: AssetExecutionContext, core, batch, namespace: str, name: str, frozen: Callable[[], str | None]
) -> tuple[str, str]:
    """Wait for the Job to complete or fail: (condition, message). Progress changes and pod 0's logs
    go to the run's log; `Frozen` once `frozen` (the heartbeat watch) says why."""
    streams: dict[str, threading.Thread] = {}
    said = ""
    while True:
        found = batch.read_namespaced_job(name, namespace)
        for cond in found.status.conditions or []:
            if cond.status == "True" and cond.type in ("Complete", "Failed"):
                for thread in streams.values():
                    thread.join(timeout=30)
                return cond.type, cond.message or cond.reason or ""
        status = found.status
        now = (
            "suspended: waiting in Kueue queue for admission"
            if found.spec.suspend
            else f"{status.active or 0} active ({status.ready or 0} ready), {status.succeeded or 0} succeeded, "
            f"{status.failed or 0} failed of {found.spec.completions}"
        )
        if now != said:
            context.log.info(f"Kubernetes Job {namespace}/{name}: {now}")
            said = now
        _stream_pod0(context, core, namespace, name, streams)
        reason = frozen()
        if reason:
            raise Frozen(reason)
        time.sleep(POLL_SECONDS)


def _stream_pod0(
    context: AssetExecutionContext, core, namespace: str, name: str, streams: dict[str, threading.Thread]
) -> None:
    """Follow the logs of node 0's pod once it has started (and of its replacement, if it had one)."""
    pods = core.list_namespaced_pod(namespace, label_selector=f"{JOB_LABEL}={name}").items
    for pod in pods:
        started = pod.status.phase in ("Running", "Succeeded", "Failed")
        if (
            started
            and (pod.metadata.annotations or {}).get(INDEX_ANNOTATION) == "0"
            and pod.metadata.name not in streams
        ):
            thread = threading.Thread(target=_pod_logs, args=(context, core, namespace, pod.metadata.name), daemon=True)
            thread.start()
            streams[pod.metadata.name] = thread


def _pod_logs(context: AssetExecutionContext, core, namespace: str, pod: str) -> None:
    try:
        stream = core.read_namespaced_pod_log(pod, namespace, container=CONTAINER, follow=True, _preload_content=False)
        for line in stream:
            context.log.info(f"[{pod}] {line.decode(errors='replace').rstrip()}")
    except Exception as exc:  # the logs are a convenience: the run's outcome is read from the Job
        context.log.warning(f"stopped following the logs of pod {namespace}/{pod}: {exc}")


def _delete(context: AssetExecutionContext, core, batch, namespace: str, name: str, created: list[str]) -> None:
    """Delete this launch's Job (with its pods) and Service, and wait until the Job is gone."""
    import kubernetes
    from kubernetes.client.exceptions import ApiException

    body = kubernetes.client.V1DeleteOptions(propagation_policy="Foreground")
    delete = {"Job": batch.delete_namespaced_job, "Service": core.delete_namespaced_service}
    for kind in created:
        try:
            delete[kind](name, namespace, body=body)
        except ApiException as exc:
            if exc.status != 404:
                context.log.warning(
                    f"could not delete Kubernetes {kind} {namespace}/{name} ({exc.status} "
                    f"{exc.reason}): delete it with `kubectl -n {namespace} delete {kind.lower()} {name}`"
                )
    deadline = time.monotonic() + DELETE_WAIT_SECONDS
    while "Job" in created and time.monotonic() < deadline:
        try:
            batch.read_namespaced_job(name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return
        time.sleep(2)
    if "Job" in created:
        context.log.warning(f"Kubernetes Job {namespace}/{name} is still terminating after {DELETE_WAIT_SECONDS:.0f}s")

"""Kubernetes manifests for a run's ranks: one pod per node, each with its node's GPUs.

One node is one pod running `torchrun --standalone` (dagster-k8s Pipes submits it and reads its logs).
Several nodes are an Indexed Job plus a headless Service, so that pod 0 has a stable DNS name,
`<job>-0.<service>`, for the c10d rendezvous before any pod has an address. torchrun numbers the
nodes by sorting their host names (`<job>-<index>.<service>...`), so pod 0 is node rank 0.

Plain dicts in the API's camelCase: the launcher submits them, the tests validate them offline
against the Kubernetes schema. Secrets are only ever referenced by name (envFrom), never read.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any

from ghostvis_core.errors import GhostvisError
from ghostvis_core.launch.cluster.torchrun_command import Rendezvous, node_grace_s, torchrun_command
from ghostvis_core.plan.config import RuntimeConfig
from ghostvis_core.runs.job_command import TRAINING_ENTRY

CONTAINER = "trainer"
JOB_LABEL = "ghostvis.io/job"  # on every pod of one launch: the headless Service selects by it
STAGE_LABEL = "ghostvis.io/stage"
RUN_KEY_ANNOTATION = "ghostvis.io/run-key"  # run keys may hold characters a label value may not
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
NAME_MAX = 52  # an indexed pod's hostname is <job>-<index>: it must stay a 63-character DNS label
GPU_RESOURCE = "nvidia.com/gpu"


def _gpu_tolerations() -> list[dict[str, str]]:
    """GPU node pools are commonly tainted so that only GPU pods land there."""
    return [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]


@dataclass
class KubernetesJob:
    """Where a run's pods go and what each gets (the `launcher.kubernetes` config)."""

    image: str = ""  # the training image (Dockerfile at the repo root), pushed to a registry the cluster pulls from
    nodes: int = 1  # pods; more than one: an Indexed Job with the c10d rendezvous on pod 0
    gpus_per_node: int = 8  # nvidia.com/gpu per pod; 0: CPU pods (gloo)
    cpu: int = 32  # cores per pod (requests = limits); also sets each rank's OMP threads
    memory: str = "256Gi"
    shm_size: str = "64Gi"  # /dev/shm as a memory emptyDir: NCCL and loader workers outgrow the 64Mi default
    namespace: str = "default"
    store_claim: str = ""  # a ReadWriteMany PVC holding the artifact store, mounted where the Dagster host has it
    env: dict[str, str] = field(default_factory=dict)  # plain settings only: credentials go in `secrets`
    secrets: list[str] = field(default_factory=list)  # Secret names, each loaded whole as environment (envFrom)
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, str]] = field(default_factory=_gpu_tolerations)
    queue: str = ""  # a Kueue LocalQueue: the Job waits there (suspended) until its GPUs are admitted
    service_account: str = ""
    image_pull_policy: str = "IfNotPresent"
    image_pull_secrets: list[str] = field(default_factory=list)
    rdzv_port: int = 29400  # pod 0's c10d rendezvous port
    # No grace setting here: a pod's terminationGracePeriodSeconds (between an eviction's SIGTERM, which torchrun
    # passes to the ranks, and the kill) is the stage's runtime.preempt_grace_s plus torchrun's own exit.


@dataclass(frozen=True)
class RunTarget:
    """What the pods run: one job's module on its spec, with the environment every rank gets."""

    stage: str
    run_key: str
    spec_uri: str  # what `--spec` names, as the pods see it
    store_path: str  # where the store claim is mounted (the store's folder on the Dagster host)
    nproc_per_node: int
    env: dict[str, str] = field(default_factory=dict)
    module: str = TRAINING_ENTRY  # the job's module and its arguments after --spec (ghostvis_core/runs/job_command.py)
    args: tuple[str, ...] = ()
    grace_s: float = RuntimeConfig.preempt_grace_s  # the stage's runtime.preempt_grace_s


def resource_name(stage: str, run_key: str) -> str:
    """A DNS-1123 (and DNS-1035) label for one run's Job and Service: readable, and a hash of the
    original when it had to be cleaned or shortened, so two runs never share a name."""
    raw = f"gv-{stage}-{run_key}"
    clean = re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", raw.lower())).strip("-")
    if clean == raw and len(clean) <= NAME_MAX:
        return clean
    digest = hashlib.sha256(raw.encode()).hexdigest()[:8]
    return f"{clean[: NAME_MAX - len(digest) - 1].rstrip('-')}-{digest}"


def check_config(job: KubernetesJob) -> None:
    """Refuse a config that names no image or no node, before anything is derived from it."""
    if not job.image:
        raise GhostvisError(
            "launcher kubernetes.image is empty: build and push the training image "
            "(docs/launch-kubernetes.md) and set kubernetes.image to its reference"
        )
    if job.nodes < 1:
        raise GhostvisError(f"launcher kubernetes.nodes={job.nodes}: give 1 or more")


def check_job(job: KubernetesJob, run: RunTarget) -> None:
    """Refuse a config the cluster would accept but the run cannot use, naming the field to fix."""
    check_config(job)
    if job.gpus_per_node and run.nproc_per_node != job.gpus_per_node:
        raise GhostvisError(
            f"{run.stage}: {run.nproc_per_node} rank(s) per node but kubernetes.gpus_per_node="
            f"{job.gpus_per_node}; each rank drives one GPU: set gpus_per_node="
            f"{run.nproc_per_node}, or batch.world_size={job.nodes * job.gpus_per_node}"
        )
    if job.store_claim and not run.store_path.startswith("/"):
        raise GhostvisError(
            f"launcher kubernetes.store_claim={job.store_claim} needs an absolute store folder "
            f"to mount it at, got '{run.store_path}'"
        )


def meta(job: KubernetesJob, run: RunTarget, queued: bool) -> dict[str, Any]:
    """Labels and the run key of the object Kueue queues (`queued`: the one pod, or the Job, never
    the Job's pods); names are the submitter's."""
    labels = {
        "app.kubernetes.io/name": "ghostvis",
        "app.kubernetes.io/component": "training",
        JOB_LABEL: resource_name(run.stage, run.run_key),
        STAGE_LABEL: run.stage,
    }
    if queued and job.queue:
        labels[QUEUE_LABEL] = job.queue
    return {"labels": labels, "annotations": {RUN_KEY_ANNOTATION: run.run_key}}


def _resources(job: KubernetesJob) -> dict[str, Any]:
    """Requests equal to limits (Guaranteed QoS: the last pods evicted under node pressure)."""
    amount: dict[str, Any] = {"cpu": str(job.cpu), "memory": job.memory}
    if job.gpus_per_node:
        amount[GPU_RESOURCE] = str(job.gpus_per_node)
    return {"requests": dict(amount), "limits": dict(amount)}


def _volumes(job: KubernetesJob, run: RunTarget) -> tuple[list[dict], list[dict]]:
    """(volumes, mounts): a memory-backed /dev/shm, and the store claim at the store's own path, so
    every path in the spec means the same file on every pod and on the Dagster host."""
    volumes: list[dict] = [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": job.shm_size}}]
    mounts: list[dict] = [{"name": "shm", "mountPath": "/dev/shm"}]
    if job.store_claim:
        volumes.append({"name": "store", "persistentVolumeClaim": {"claimName": job.store_claim}})
        mounts.append({"name": "store", "mountPath": run.store_path})
    return volumes, mounts


def _container(job: KubernetesJob, run: RunTarget, command: list[str], mounts: list[dict]) -> dict[str, Any]:
    env = [{"name": k, "value": v} for k, v in {**run.env, **job.env}.items()]
    container = {
        "name": CONTAINER,
        "image": job.image,
        "imagePullPolicy": job.image_pull_policy,
        "command": command,
        "env": env,
        "resources": _resources(job),
        "volumeMounts": mounts,
    }
    if job.secrets:
        container["envFrom"] = [{"secretRef": {"name": name}} for name in job.secrets]
    return container


def pod_spec(job: KubernetesJob, run: RunTarget, command: list[str], subdomain: str = "") -> dict[str, Any]:
    """The PodSpec of one node: one container with all its ranks (torchrun starts them)."""
    volumes, mounts = _volumes(job, run)
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": node_grace_s(run.grace_s),
        "volumes": volumes,
        "containers": [_container(job, run, command, mounts)],
    }
    optional = {
        "subdomain": subdomain,
        "nodeSelector": job.node_selector,
        "tolerations": job.tolerations,
        "serviceAccountName": job.service_account,
        "imagePullSecrets": [{"name": name} for name in job.image_pull_secrets],
    }
    spec.update({k: v for k, v in optional.items() if v})
    return spec


def render_pod(job: KubernetesJob, run: RunTarget) -> tuple[dict[str, Any], dict[str, Any]]:
    """(metadata, PodSpec) of a one-node run: what dagster-k8s Pipes takes as base_pod_meta and
    base_pod_spec (it names the pod and adds the Pipes environment)."""
    check_job(job, run)
    command = torchrun_command(
        run.spec_uri, run.nproc_per_node, python="python", module=run.module, args=run.args, grace_s=run.grace_s
    )
    return meta(job, run, queued=True), pod_spec(job, run, command)


def render_service(job: KubernetesJob, run: RunTarget) -> dict[str, Any]:
    """A headless Service over the Job's pods: `<job>-<i>.<service>` resolves to pod i, published
    before the pod is ready, because the rendezvous happens before anything would be ready."""
    name = resource_name(run.stage, run.run_key)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": job.namespace, "labels": meta(job, run, False)["labels"]},
        "spec": {
            "clusterIP": "None",
            "selector": {JOB_LABEL: name},
            "publishNotReadyAddresses": True,
            "ports": [{"name": "rdzv", "port": job.rdzv_port, "targetPort": job.rdzv_port}],
        },
    }


def rendezvous(job: KubernetesJob, run: RunTarget) -> Rendezvous:
    """Every node meets at pod 0."""
    name = resource_name(run.stage, run.run_key)
    return Rendezvous(nnodes=job.nodes, endpoint=f"{name}-0.{name}:{job.rdzv_port}", rdzv_id=run.run_key)


# The Job fails at the first failed pod (a rank's error is the run's error: retrying is Dagster's
# decision, through a resume), except when the cluster took the pod away (preemption, drain).
POD_FAILURE_POLICY = {
    "rules": [
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        {"action": "FailJob", "onExitCodes": {"containerName": CONTAINER, "operator": "NotIn", "values": [0]}},
    ]
}


def render_job(job: KubernetesJob, run: RunTarget) -> dict[str, Any]:
    """The Indexed Job of a multi-node run: `nodes` pods at once, each a torchrun node."""
    check_job(job, run)
    name = resource_name(run.stage, run.run_key)
    command = torchrun_command(
        run.spec_uri,
        run.nproc_per_node,
        rendezvous(job, run),
        python="python",
        module=run.module,
        args=run.args,
        grace_s=run.grace_s,
    )
    spec = pod_spec(job, run, command, subdomain=name)
    spec["containers"][0]["ports"] = [{"name": "rdzv", "containerPort": job.rdzv_port}]
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": job.namespace, **meta(job, run, queued=True)},
        "spec": {
            "completionMode": "Indexed",
            "completions": job.nodes,
            "parallelism": job.nodes,
            "backoffLimit": 0,
            "podFailurePolicy": POD_FAILURE_POLICY,
            "suspend": bool(job.queue),  # Kueue admits (unsuspends) it when the GPUs are free
            "template": {"metadata": meta(job, run, queued=False), "spec": spec},
        },
    }


def render_indexed_job(job: KubernetesJob, run: RunTarget) -> tuple[dict[str, Any], dict[str, Any]]:
    """(Service, Job) of a multi-node run, in the order they must be created."""
    return render_service(job, run), render_job(job, run)

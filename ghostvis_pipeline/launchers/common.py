"""What every launcher shares: the job's environment, and reading how the run ended from the store."""

from __future__ import annotations

import os
from collections.abc import Callable

from dagster import Failure

from ghostvis_core.home import Home
from ghostvis_core.launch.cluster.slurm_script import is_secret
from ghostvis_core.launch.cluster.torchrun_command import worker_env
from ghostvis_core.run.hf.register import MODEL_FILE, REGISTER_ENTRY
from ghostvis_core.runs.heartbeats import FrozenJobWatch
from ghostvis_core.runs.job_command import TRAINING_ENTRY, Job
from ghostvis_core.runs.launch_spec import LaunchSpec
from ghostvis_core.runs.reasons import clear_reasons, run_reason

# Named launcher profiles: environment settings known to be needed on some clusters, chosen by
# name instead of edited into code (e.g. NCCL hangs on nodes without NVLink / InfiniBand).
LAUNCH_PROFILES: dict[str, dict[str, str]] = {
    "local": {},
    "no-nvlink": {"NCCL_P2P_DISABLE": "1"},
    "no-infiniband": {"NCCL_IB_DISABLE": "1"},
    "pcie-cloud": {"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1"},
}


def job_env(profile: str, nproc_per_node: int, cpus: int | None = None) -> dict[str, str]:
    """Environment every rank gets: threads per rank and the profile's settings."""
    if profile not in LAUNCH_PROFILES:
        raise Failure(f"launcher profile '{profile}' is unknown; choose one of {sorted(LAUNCH_PROFILES)}")
    return {**worker_env(nproc_per_node, cpus), **LAUNCH_PROFILES[profile]}


def host_environment(send_credentials: bool) -> dict[str, str]:
    """This host's environment for what starts a job elsewhere (sbatch, a node shell), with or without
    its credentials (launcher send_credentials; without: the nodes use their own environment,
    credentials file or instance role)."""
    return {name: value for name, value in os.environ.items() if send_credentials or not is_secret(name)}


_LAUNCHES: dict[tuple[str, int], int] = {}


def attempt_name(context) -> str:
    """The name of this launch's files (sbatch script, job output, Pipes messages): the Dagster run and retry,
    and after a preemption the relaunch's number (`run_job` launches again within the same retry)."""
    key = (context.run_id, context.retry_number)
    n = _LAUNCHES[key] = _LAUNCHES.get(key, -1) + 1
    return f"{context.run_id[:8]}-{context.retry_number}" + (f"-p{n}" if n else "")


def training_job(spec: LaunchSpec) -> Job:
    """A stage run's training job: its world size of ranks, done when its RunResult is in the store."""
    return Job(
        stage=spec.stage,
        run_key=spec.run_key,
        module=TRAINING_ENTRY,
        ranks=spec.config.batch.world_size,
        mlflow_tracking_uri=spec.mlflow_tracking_uri,
        done=("run_record", spec.stage, spec.run_key),
        runtime=spec.config.runtime,
    )


def registration_job(spec: LaunchSpec, tracking_uri: str) -> Job:
    """A completed run's registration job (a cache hit's): one rank, on the run's own spec and in its folder,
    registering in `tracking_uri` (this home's MLflow, which may not be the one the run was trained under)."""
    return Job(
        stage=spec.stage,
        run_key=spec.run_key,
        module=REGISTER_ENTRY,
        ranks=1,
        mlflow_tracking_uri=tracking_uri,
        done=("run_file", spec.stage, spec.run_key, MODEL_FILE),
        args=("--tracking-uri", tracking_uri),
    )


def spec_uri(home: Home, target: Job) -> str:
    """Where every node reads the job's spec (a path in the shared store)."""
    return home.store.uri_of("run_spec", target.stage, target.run_key)


def frozen_watch(home: Home, target: Job) -> Callable[[], str | None]:
    """The launching side's check for a frozen job (none moves its heartbeat for runtime.hang_timeout_s)."""
    return FrozenJobWatch(home.store, target.stage, target.run_key, target.ranks, target.runtime.hang_timeout_s).frozen


def clear_reason(home: Home, target: Job) -> None:
    """An earlier attempt's failure reasons are not this one's."""
    clear_reasons(home.store, target.stage, target.run_key)


def failure(home: Home, target: Job, fallback: str, allow_retries: bool = True, cancelled: bool = False) -> Failure:
    """The run's own reason (the first failing rank's, then the others', left in the store by the ranks),
    then the launcher's; the launcher's alone when no rank left one. `cancelled`: the scheduler says someone
    cancelled the job (its ranks saw a SIGTERM as a preemption would, but nothing is to be launched again)."""
    reason = run_reason(home.store, target.stage, target.run_key)
    told = f"{reason}\n({fallback})" if reason else fallback
    return Failure(
        f"{target.stage} run {target.run_key} failed: {told}",
        allow_retries=allow_retries,
        metadata={CANCELLED: cancelled},
    )


CANCELLED = "cancelled"  # Failure metadata: the job was cancelled on purpose (run_job does not launch it again)


def require_result(home: Home, target: Job) -> None:
    """A launch succeeded only if the job left its record in the store (a run's RUN_COMPLETE, the
    evaluation's results)."""
    if not home.store.exists(*target.done):
        raise failure(home, target, f"{target.module} exited without reporting its results")

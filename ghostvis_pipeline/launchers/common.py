"""What every launcher shares: the job's environment, and reading how the run ended from the store."""

from __future__ import annotations

import os

from dagster import Failure

from ghostvis_core.home import Home
from ghostvis_core.run.cluster.slurm import is_secret
from ghostvis_core.run.cluster.torchrun import worker_env
from ghostvis_core.run.train.reasons import clear_reasons, run_reason
from ghostvis_core.run.train.spec import LaunchSpec

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


def spec_uri(home: Home, spec: LaunchSpec) -> str:
    """Where every node reads the run's spec (a path in the shared store)."""
    return home.store.uri_of("run_spec", spec.stage, spec.run_key)


def clear_reason(home: Home, spec: LaunchSpec) -> None:
    """An earlier attempt's failure reasons are not this one's."""
    clear_reasons(home.store, spec.stage, spec.run_key)


def failure(
    home: Home, spec: LaunchSpec, fallback: str, allow_retries: bool = True, cancelled: bool = False
) -> Failure:
    """The run's own reason (the first failing rank's, then the others', left in the store by the ranks),
    then the launcher's; the launcher's alone when no rank left one. `cancelled`: the scheduler says someone
    cancelled the job (its ranks saw a SIGTERM as a preemption would, but nothing is to be launched again)."""
    reason = run_reason(home.store, spec.stage, spec.run_key)
    told = f"{reason}\n({fallback})" if reason else fallback
    return Failure(
        f"{spec.stage} run {spec.run_key} failed: {told}",
        allow_retries=allow_retries,
        metadata={CANCELLED: cancelled},
    )


CANCELLED = "cancelled"  # Failure metadata: the job was cancelled on purpose (run_job does not launch it again)


def require_result(home: Home, spec: LaunchSpec) -> None:
    """A launch succeeded only if the run left its record (RUN_COMPLETE) in the store."""
    if not home.store.exists("run_record", spec.stage, spec.run_key):
        raise failure(home, spec, "training exited without reporting its results")

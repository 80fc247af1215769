"""What every launcher shares: the job's environment, and reading how the run ended from the store."""

from __future__ import annotations

from dagster import Failure

from ghostvis_core.home import Home
from ghostvis_core.cluster.torchrun import worker_env
from ghostvis_core.train.spec import LaunchSpec

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


def spec_uri(home: Home, spec: LaunchSpec) -> str:
    """Where every node reads the run's spec (a path in the shared store)."""
    return home.store.uri_of("run_spec", spec.stage, spec.run_key)


def clear_reason(home: Home, spec: LaunchSpec) -> None:
    """An earlier attempt's failure reason is not this one's."""
    home.store.delete("run_error", spec.stage, spec.run_key)


def failure(home: Home, spec: LaunchSpec, fallback: str, allow_retries: bool = True) -> Failure:
    """The run's own one-line reason (left in the store by a rank) or the launcher's."""
    failed = home.store.exists("run_error", spec.stage, spec.run_key)
    reason = home.store.read_text("run_error", spec.stage, spec.run_key).strip() if failed else fallback
    return Failure(f"{spec.stage} run {spec.run_key} failed: {reason}", allow_retries=allow_retries)


def require_result(home: Home, spec: LaunchSpec) -> None:
    """A launch succeeded only if the run left its record (RUN_COMPLETE) in the store."""
    if not home.store.exists("run_record", spec.stage, spec.run_key):
        raise failure(home, spec, "training exited without reporting its results")

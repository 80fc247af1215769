"""Resources: where state lives (GhostvisHome) and how a stage's torchrun job is launched."""

from __future__ import annotations

from pathlib import Path

from dagster import AssetExecutionContext, ConfigurableResource, Failure, PipesSubprocessClient

from ghostvis_core.home import Home
from ghostvis_core.train.launch import launch_env, torchrun_command
from ghostvis_core.train.spec import LaunchSpec

# Named launcher profiles: environment settings known to be needed on some clusters, chosen by
# name instead of edited into code (e.g. NCCL hangs on nodes without NVLink / InfiniBand).
LAUNCH_PROFILES: dict[str, dict[str, str]] = {
    "local": {},
    "no-nvlink": {"NCCL_P2P_DISABLE": "1"},
    "no-infiniband": {"NCCL_IB_DISABLE": "1"},
    "pcie-cloud": {"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1"},
}


class GhostvisHome(ConfigurableResource):
    """GHOSTVIS_HOME: artifact store, MLflow store. Empty = the environment's value (read at run time)."""

    root: str = ""

    def home(self) -> Home:
        return Home(Path(self.root).resolve()) if self.root else Home.from_env()


class TorchrunLauncher(ConfigurableResource):
    """Runs `torchrun -m ghostvis_core.train --spec ...` on this machine through Dagster Pipes.

    On a cluster the same spec runs on GPU nodes (a Pipes client for Kubernetes or Slurm, or
    multi-node torchrun); the stage code does not change, only this resource.
    """

    nproc_per_node: int = 0  # 0: the stage config's batch.world_size
    profile: str = "local"

    def run(self, context: AssetExecutionContext, spec: LaunchSpec, home: Home) -> None:
        """Train the run to completion; its RunResult is then in the store (kind run_record)."""
        if self.profile not in LAUNCH_PROFILES:
            raise Failure(f"launcher profile '{self.profile}' is unknown; choose one of {sorted(LAUNCH_PROFILES)}")
        nproc = self.nproc_per_node or int(spec.config["batch"]["world_size"])
        cmd = torchrun_command(home.store.path("run_spec", spec.stage, spec.run_key), nproc)
        context.log.info(f"launching: {' '.join(cmd)}")
        home.store.delete("run_error", spec.stage, spec.run_key)  # an earlier attempt's reason is not this one's
        client = PipesSubprocessClient(env={**launch_env(nproc), **LAUNCH_PROFILES[self.profile]})
        try:
            invocation = client.run(command=cmd, context=context)
        except Exception as exc:
            failed = home.store.exists("run_error", spec.stage, spec.run_key)
            reason = home.store.read_text("run_error", spec.stage, spec.run_key).strip() if failed else str(exc)
            raise Failure(f"{spec.stage} run {spec.run_key} failed: {reason}") from None
        if not home.store.exists("run_record", spec.stage, spec.run_key) or not invocation.get_results():
            raise Failure(f"{spec.stage} run {spec.run_key}: training exited without reporting its results")

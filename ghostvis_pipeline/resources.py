"""Resources: where state lives (GhostvisHome) and how a stage's torchrun job is launched."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dagster import AssetExecutionContext, ConfigurableResource, Failure, PipesSubprocessClient

from ghostvis_core.home import Home
from ghostvis_core.train.launch import error_file, launch_env, spec_path, torchrun_command
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
    """GHOSTVIS_HOME: artifact store, run specs, MLflow store. Empty = the environment's value."""

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

    def run(self, context: AssetExecutionContext, spec: LaunchSpec, home: Home) -> dict[str, Any]:
        if self.profile not in LAUNCH_PROFILES:
            raise Failure(f"launcher profile '{self.profile}' is unknown; choose one of {sorted(LAUNCH_PROFILES)}")
        nproc = self.nproc_per_node or int(spec.config["batch"]["world_size"])
        cmd = torchrun_command(spec_path(home, spec), nproc)
        context.log.info(f"launching: {' '.join(cmd)}")
        error_file(home, spec).unlink(missing_ok=True)  # a reason left by an earlier attempt is not this one's
        client = PipesSubprocessClient(env={**launch_env(nproc), **LAUNCH_PROFILES[self.profile]})
        try:
            invocation = client.run(command=cmd, context=context)
        except Exception as exc:
            err = error_file(home, spec)
            reason = err.read_text().strip() if err.exists() else str(exc)
            raise Failure(f"{spec.stage} run {spec.run_key} failed: {reason}") from None
        results = invocation.get_results()
        mats = [r for r in results if hasattr(r, "metadata") and r.metadata]
        if not mats:
            raise Failure(f"{spec.stage} run {spec.run_key}: training exited without reporting its results")
        return {k: getattr(v, "value", v) for k, v in mats[-1].metadata.items()}

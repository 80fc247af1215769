"""The `launcher` resource: where a heavy job runs (a stage's training, the evaluation, tokenizer training, a
cache hit's registration: ghostvis_core/runs/job_command.py), chosen by config, never by the asset's code.

    kind: local       torchrun on the Dagster host (the default)
    kind: torchrun    multi-node torchrun with a c10d rendezvous (nodes started by hand or another scheduler)
    kind: slurm       an sbatch job: `srun torchrun` on N nodes, followed, streamed, cancelled with the run
    kind: kubernetes  pods through dagster-k8s Pipes: one pod per node, an indexed Job for several

Every launcher runs the job's module under torchrun on its spec in the same store; when it returns, the
job's record is in the store (its `done` key: a run's RunResult, kind run_record; the evaluation's scores).
"""

from __future__ import annotations

from dagster import AssetExecutionContext, Config, ConfigurableResource, Failure
from pydantic import Field

from ghostvis_core.home import Home
from ghostvis_core.runs.job_command import Job
from ghostvis_pipeline.launchers.kubernetes import KubernetesConfig, run_kubernetes
from ghostvis_pipeline.launchers.local import run_local
from ghostvis_pipeline.launchers.slurm import SlurmConfig, run_slurm
from ghostvis_pipeline.launchers.torchrun import MultiNodeConfig, run_torchrun

LAUNCHERS = {"local": run_local, "torchrun": run_torchrun, "slurm": run_slurm, "kubernetes": run_kubernetes}


class Launcher(ConfigurableResource):
    """How and where a job's ranks are started."""

    kind: str = Field("local", description="local | torchrun | slurm | kubernetes")
    nproc_per_node: int = Field(0, description="ranks per node; 0: the stage's batch.world_size / nodes")
    profile: str = Field("local", description="named environment settings: local, no-nvlink, no-infiniband, pcie-cloud")
    send_credentials: bool = Field(
        True,
        description="false: no credential of the Dagster host's environment "
        "(AWS_*, MLFLOW_TRACKING_PASSWORD/TOKEN, any *SECRET*/*TOKEN*/*KEY*) goes to "
        "sbatch (slurm) or a node shell (torchrun); the nodes use their own (environment, "
        "credentials file, instance role). kubernetes sends only the Secrets it lists",
    )
    torchrun: MultiNodeConfig = MultiNodeConfig()
    slurm: SlurmConfig = SlurmConfig()
    kubernetes: KubernetesConfig = KubernetesConfig()

    def nodes(self) -> int:
        if self.kind == "torchrun":
            return self.torchrun.nnodes
        if self.kind == "slurm":
            return self.slurm.nodes
        if self.kind == "kubernetes":
            return self.kubernetes.nodes
        return 1

    def ranks_per_node(self, target: Job) -> int:
        """Ranks on each node; the job's world size must be nodes x ranks per node."""
        if target.ranks == 1:
            return 1
        world, nodes = target.ranks, self.nodes()
        per_node = self.nproc_per_node or world // nodes
        if per_node * nodes != world:
            raise Failure(
                f"{target.stage}: batch.world_size={world} is not {nodes} node(s) x {per_node} rank(s); "
                f"set launcher nproc_per_node and nodes so that they multiply to {world}, or set "
                f"batch.world_size",
                allow_retries=False,
            )
        return per_node

    def sized(self, cluster: Config, target: Job) -> dict:
        """The launcher's slurm or kubernetes settings (`cluster`) for the job: as set, for a job of several ranks;
        one node with at most one GPU for a one-rank job (the evaluation, a cache hit's registration)."""
        fields = cluster.model_dump()
        if target.ranks == 1:
            fields |= {"nodes": 1, "gpus_per_node": min(fields["gpus_per_node"], 1)}
        return fields

    def run(self, context: AssetExecutionContext, target: Job, home: Home) -> None:
        """Run the job to completion; its record (`target.done`) is then in the store. A one-node job of a
        multi-node torchrun launcher runs on this host (its c10d rendezvous would wait for the other nodes)."""
        if self.kind not in LAUNCHERS:
            raise Failure(
                f"launcher kind '{self.kind}' is unknown; choose one of {', '.join(LAUNCHERS)}", allow_retries=False
            )
        kind = "local" if self.kind == "torchrun" and target.ranks == 1 else self.kind
        LAUNCHERS[kind](context, target, home, self)

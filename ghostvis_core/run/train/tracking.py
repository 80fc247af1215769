"""What a run reports while it trains: progress lines, MLflow metrics, dataset inputs and system
metrics (rank 0, off the training thread) and Dagster Pipes logs. Other ranks get the same object
and it stays silent."""

from __future__ import annotations

from typing import Any

from ghostvis_core.run.track.mlflow_run import MlflowRun, MlflowTarget
from ghostvis_core.run.track.pipes import PipesReporter
from ghostvis_core.run.track.shard_input import ShardInput
from ghostvis_core.run.train.dist import DistContext, print0
from ghostvis_core.run.train.spec import LaunchSpec


class Tracker:
    def __init__(self, spec: LaunchSpec, ctx: DistContext, params: dict[str, Any], *, run_id: str | None, segment: int):
        self.ctx = ctx
        self.mlflow = self.pipes = None
        if ctx.is_main:
            self.mlflow = MlflowRun(
                MlflowTarget(
                    spec.mlflow_tracking_uri,
                    spec.mlflow_experiment,
                    spec.mlflow_artifact_location,
                    run_name=spec.run_key,
                    run_id=run_id,
                    tags={**spec.tags, "ghostvis.segment": str(segment)},
                ),
                params=params,
            )
            self.pipes = PipesReporter(True)

    def say(self, message: str, pipes: bool = False) -> None:
        print0(message, ctx=self.ctx)
        if pipes and self.pipes:
            self.pipes.log(message)

    def metrics(self, values: dict[str, float], step: int) -> None:
        if self.mlflow and values:
            self.mlflow.log_metrics(values, step=step)

    def inputs(self, shards: list[ShardInput]) -> None:
        """The shards the run read, as the MLflow run's dataset inputs."""
        if self.mlflow and shards:
            self.mlflow.log_inputs(shards)

    def run_id(self) -> str | None:
        """The MLflow run id (rank 0 waits for the run to exist; other ranks have none)."""
        return self.mlflow.wait_run_id() if self.mlflow else None

    def finish(self, tags: dict[str, str], run_key: str) -> dict[str, float]:
        """End the MLflow run (flushing what is buffered) and tell Dagster the run's key."""
        self.mlflow.set_tags(tags)
        delivery = self.mlflow.finish("FINISHED")
        self.pipes.report_materialization({"run_key": run_key})
        self.pipes.close()
        return delivery

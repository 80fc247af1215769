"""What a run reports while it trains: progress lines, MLflow metrics, dataset inputs and system
metrics (rank 0, off the training thread) and Dagster Pipes logs. Other ranks get the same object
and it stays silent.

The MLflow run is created when the loop begins (`start_mlflow`, from `Trainer.begin`), not when the tracker is
made: importing mlflow and creating the run take a while of Python on rank 0's logging thread, which holds
the GIL against what runs beside it, and every rank waits for rank 0 at the next collective. Started at setup it
would delay setup itself; started after the first step it would slow the steps whose throughput is measured;
started beside the evaluation before training, it costs the first step at most. What is logged before then waits here
and goes first."""

from __future__ import annotations

from typing import Any

from ghostvis_core.run.track.mlflow_run import MlflowRun, MlflowTarget
from ghostvis_core.run.track.pipes import PipesReporter
from ghostvis_core.run.track.shard_input import ShardInput
from ghostvis_core.run.train.dist import DistContext, print0
from ghostvis_core.runs.launch_spec import LaunchSpec


class Tracker:
    def __init__(self, spec: LaunchSpec, ctx: DistContext, params: dict[str, Any], *, run_id: str | None, segment: int):
        self.ctx = ctx
        self.mlflow: MlflowRun | None = None
        self.pipes = None
        self._target = MlflowTarget(
            spec.mlflow_tracking_uri,
            spec.mlflow_experiment,
            spec.mlflow_artifact_location,
            run_name=spec.run_key,
            run_id=run_id,
            tags={**spec.tags, "ghostvis.segment": str(segment)},
        )
        self._params = params
        self._waiting: list[tuple[dict[str, float], int]] = []  # metrics logged before the MLflow run started
        if ctx.is_main:
            self.pipes = PipesReporter(True)

    def start_mlflow(self) -> MlflowRun | None:
        """Rank 0's MLflow run, created (or resumed) on its logging thread at the first call, with the metrics
        logged until then; None on other ranks."""
        if self.ctx.is_main and self.mlflow is None:
            self.mlflow = MlflowRun(self._target, params=self._params)
            for values, step in self._waiting:
                self.mlflow.log_metrics(values, step=step)
            self._waiting = []
        return self.mlflow

    def say(self, message: str, pipes: bool = False) -> None:
        print0(message, ctx=self.ctx)
        if pipes and self.pipes:
            self.pipes.log(message)

    def metrics(self, values: dict[str, float], step: int) -> None:
        if not (self.ctx.is_main and values):
            return
        if self.mlflow is None:
            self._waiting.append((values, step))
        else:
            self.mlflow.log_metrics(values, step=step)

    def inputs(self, shards: list[ShardInput]) -> None:
        """The shards the run read, as the MLflow run's dataset inputs."""
        if self.ctx.is_main and shards:
            self.start_mlflow().log_inputs(shards)

    def run_id(self) -> str | None:
        """The MLflow run id (rank 0 waits for the run to exist; other ranks have none)."""
        return self.start_mlflow().wait_run_id() if self.ctx.is_main else None

    def suspend(self, timeout_s: float) -> None:
        """Rank 0 before a preempted job exits, after its checkpoint is committed: deliver every buffered point
        and mark the MLflow run KILLED (the resumed segment sets it RUNNING again), for at most about `timeout_s`
        (MLflow down: the points are logged again from the ledger by the resumed segment)."""
        if self.ctx.is_main:
            self.start_mlflow().finish("KILLED", timeout=timeout_s)

    def finish(self, tags: dict[str, str], run_key: str) -> dict[str, float]:
        """End the MLflow run (flushing what is buffered) and tell Dagster the run's key."""
        mlflow = self.start_mlflow()
        mlflow.set_tags(tags)
        delivery = mlflow.finish("FINISHED")
        self.pipes.report_materialization({"run_key": run_key})
        self.pipes.close()
        return delivery

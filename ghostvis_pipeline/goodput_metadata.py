"""A stage run's goodput (ghostvis_core/data/ledger/goodput.py) where its figures are read: the materialization's
metadata and, for a run this materialization trained, its MLflow run's metrics (logged from here once the last
launch ended, since only then is its timeline whole)."""

from __future__ import annotations

import time

from dagster import MetadataValue

from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.ledger.goodput import Goodput, ledger_goodput
from ghostvis_core.run.train.timeline import record_finish
from ghostvis_core.runs.run_result import RunResult
from ghostvis_core.store import Store


def goodput_metadata(context, store: Store, result: RunResult, tracking_uri: str, began: float | None) -> dict:
    """`goodput` and each category's seconds (`goodput_<category>_s`), the redone steps and the token slots; for a
    run this step trained (`began`: the step's start), its end marked first, and the same figures as the run's MLflow
    metrics (`goodput/...`). Nothing for a run with no timeline."""
    client = None
    if began is not None:
        # opened before the end mark: MLflow's import and connection are the step's own work (`other`), inside its
        # wall; only the figures' computation and their logging come after it
        client = mlflow_client(context, tracking_uri, result)
        try:
            record_finish(store, result.stage, result.run_key, began)
        except Exception as exc:  # the run stands; its goodput then ends at its last launch
            context.log.warning(f"run {result.run_key}: the end of its launching step not recorded ({exc})")
    g = ledger_goodput(Ledger.in_store(store), result.run_key)
    if g is None:
        return {}
    if client is not None:
        log_to_mlflow(context, g, client, tracking_uri, result.mlflow_run_id)
    md = {k.replace("/", "_").replace("goodput_ratio", "goodput"): v for k, v in g.metrics().items()}
    return {**md, "goodput_breakdown": MetadataValue.json(g.as_dict())}


def mlflow_client(context, tracking_uri: str, result: RunResult):
    """An MLflow client that has found the run's MLflow run; None, warned about, where MLflow cannot be reached or
    has no such run (the ledger holds the figures: `ghostvis goodput --run`)."""
    try:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=tracking_uri)
        client.get_run(result.mlflow_run_id)
        return client
    except Exception as exc:
        context.log.warning(not_logged(result.run_key, result.mlflow_run_id, tracking_uri, exc))
        return None


def log_to_mlflow(context, g: Goodput, client, tracking_uri: str, run_id: str) -> None:
    """The figures on the run's MLflow run, at its last step; an MLflow that cannot take them is warned about."""
    try:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        step = g.productive_steps
        client.log_batch(run_id, metrics=[Metric(k, float(v), now, step) for k, v in g.metrics().items()])
    except Exception as exc:
        context.log.warning(not_logged(g.run_key, run_id, tracking_uri, exc))


def not_logged(run_key: str, run_id: str, tracking_uri: str, exc: Exception) -> str:
    return (
        f"run {run_key}: its goodput figures were not logged to MLflow run {run_id} at {tracking_uri} "
        f"({type(exc).__name__}: {exc}); `ghostvis goodput --run {run_key}` reads them from the ledger"
    )

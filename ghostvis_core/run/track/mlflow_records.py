"""Reading and adding to a stage's MLflow run after training: evaluation metrics and samples, the
report's files, loss curves and token metrics for the checks. The pipeline calls these; it does not
talk to MLflow itself."""

from __future__ import annotations

import time
from pathlib import Path


def _client(tracking_uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri)


def add_to_run(
    tracking_uri: str, run_id: str, metrics: dict[str, float], step: int, texts: dict[str, str] | None = None
) -> None:
    """Metrics at `step` (one batch, one timestamp) and text artifacts (artifact path -> text)."""
    from mlflow.entities import Metric

    client = _client(tracking_uri)
    stamp = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, float(v), stamp, step) for k, v in metrics.items()])
    for artifact_path, text in (texts or {}).items():
        client.log_text(run_id, text, artifact_path)


def add_files(tracking_uri: str, run_id: str, files: list[Path], artifact_dir: str) -> None:
    client = _client(tracking_uri)
    for f in files:
        client.log_artifact(run_id, str(f), artifact_dir)


def metric_histories(tracking_uri: str, run_id: str, names: tuple[str, ...]) -> dict[str, list[tuple[int, float]]]:
    """(step, value) per metric, in the order MLflow returns them."""
    client = _client(tracking_uri)
    return {m: [(int(x.step), float(x.value)) for x in client.get_metric_history(run_id, m)] for m in names}


def latest_metrics(tracking_uri: str, run_id: str) -> dict[str, float]:
    """Each metric's newest value."""
    return dict(_client(tracking_uri).get_run(run_id).data.metrics)

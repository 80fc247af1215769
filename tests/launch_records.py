"""A launch record (spec.json, ghostvis_core/runs/launch_spec.py) for the tests that need one without
planning a run: the fields a test does not name hold placeholders that round-trip through the JSON."""

from __future__ import annotations

from typing import Any

from ghostvis_core.runs.launch_spec import LaunchSpec


def launch_record(stage: str, run_key: str, config: Any, plan: Any, **fields: Any) -> LaunchSpec:
    """The launch record of run `run_key` of `stage`; `fields` replace the placeholders (store, tokenizer,
    shards, MLflow) or set the optional fields (inputs, tags...)."""
    placeholders: dict[str, Any] = {
        "store": "/s",
        "tokenizer_id": "tok",
        "train_shards": {},
        "val_shards": {},
        "mlflow_tracking_uri": "sqlite://",
        "mlflow_experiment": "ghostvis",
        "mlflow_artifact_location": "file:///a",
    }
    return LaunchSpec(stage=stage, run_key=run_key, config=config, plan=plan, **{**placeholders, **fields})

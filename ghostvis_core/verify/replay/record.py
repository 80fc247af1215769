"""Where a run's replay verdict is kept (the store's report `replay/<stage>/<run_key>.json`) and its few words
for the report card; light to import (no torch), as the report card's writer imports it."""

from __future__ import annotations

from typing import Any

from ghostvis_core.store import Store


def record_path(stage: str, run_key: str) -> str:
    return f"replay/{stage}/{run_key}.json"


def write_record(store: Store, stage: str, run_key: str, verdict: dict[str, Any]) -> None:
    store.write_json("report", record_path(stage, run_key), data=verdict)


def read_record(store: Store, stage: str, run_key: str) -> dict[str, Any] | None:
    """The run's kept replay verdict (CheckOutcome.to_dict), or None when it was never replayed."""
    if not store.exists("report", record_path(stage, run_key)):
        return None
    return store.read_json("report", record_path(stage, run_key))


def replay_summary(store: Store, stage: str, run_key: str) -> str:
    """The run's replay verdict in a few words ("2 intervals replayed, bitwise equal"), or how to get one."""
    kept = read_record(store, stage, run_key)
    return kept["figures"]["summary"] if kept else f"not replayed (ghostvis audit --stage {stage} --replay K)"

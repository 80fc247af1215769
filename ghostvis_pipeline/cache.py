"""Cache hits: a stage whose run identity equals a completed run whose checks passed returns that run.

The identity is in the run key (ghostvis_core/launch/start.py `plan_run`); whether the run's checks
passed is read from the Dagster instance (the asset check executions of the materializations that
carried the run key), so a run whose checks failed, or were never run, is not reused.
"""

from __future__ import annotations

from dataclasses import dataclass

from dagster import AssetCheckKey, AssetKey, RunsFilter

from ghostvis_core import identity
from ghostvis_core.launch.start import TRAINING_MODULES, PlannedRun
from ghostvis_core.runs.lookup import completed_attempts
from ghostvis_core.store import Store
from ghostvis_pipeline.metadata import materializations

# check executions looked at per check, newest first (Dagster reads at most 10,000 records at a time)
HISTORY = 10_000


@dataclass(frozen=True)
class CacheHit:
    run_key: str
    why: str  # for the `cached_from` metadata


def materialized_in(instance, asset: str, run_key: str) -> set[str]:
    """Dagster run ids whose materialization of `asset` carried `run_key`."""
    out = set()
    for rec in materializations(instance, AssetKey(asset)):
        md = rec.event_log_entry.asset_materialization.metadata
        if getattr(md.get("run_key"), "value", None) == run_key:
            out.add(rec.run_id)
    return out


def checks_passed_in(instance, asset: str, run_key: str, checks: list[str]) -> str | None:
    """The newest Dagster run in which every check of `asset` passed on `run_key`, if no execution
    of any of them on that run key failed (a failure is never hidden by a later pass); else None."""
    runs = materialized_in(instance, asset, run_key)
    passed_in = set(runs)
    for name in checks:
        history = instance.event_log_storage.get_asset_check_execution_history(
            AssetCheckKey(AssetKey(asset), name), limit=HISTORY
        )
        mine = [r for r in history if r.run_id in runs]
        if any(r.status.value not in ("SUCCEEDED", "PLANNED") for r in mine):
            return None
        passed_in &= {r.run_id for r in mine if r.status.value == "SUCCEEDED"}
    if not passed_in:
        return None
    return instance.get_runs(filters=RunsFilter(run_ids=sorted(passed_in)), limit=1)[0].run_id  # newest first


def cached_stage_run(instance, store: Store, asset: str, planned: PlannedRun, checks: list[str]) -> CacheHit | None:
    """The newest completed attempt of the planned run's identity whose checks passed, with why it matched."""
    for run_key in completed_attempts(store, planned.stage, planned.base_key):
        dagster_run = checks_passed_in(instance, asset, run_key, checks)
        if dagster_run is None:
            continue
        ident = planned.identity
        why = (
            f"identity {planned.base_key.rsplit('-', 1)[-1]} equals that of completed run {run_key}: same config "
            f"(rank split aside), tokenizer {ident['tokenizer']}, "
            f"{sum(len(v) for v in ident['train'].values())} train and "
            f"{sum(len(v) for v in ident['validation'].values())} validation shards by content, upstream "
            f"{ident['upstream'] or 'none'}; its {len(checks)} checks passed in Dagster run {dagster_run}"
        )
        return CacheHit(run_key, why + code_note(store, planned.stage, run_key))
    return None


def code_note(store: Store, stage: str, run_key: str) -> str:
    """Says so when the cached run was made by other code than today's (force: true retrains with it)."""
    now = identity.code_version(*TRAINING_MODULES)
    record = store.read_json("identity", stage, run_key) if store.exists("identity", stage, run_key) else {}
    then = record.get("code_version")
    if then == now:
        return f"; same code version {now}"
    return (
        f"; made by code version {then or 'unknown'}, the code is now {now}: set force: true in the run "
        "config to retrain with it"
    )


def changed_since(store: Store, stage: str, planned: PlannedRun) -> dict | None:
    """On a miss: which inputs differ from the stage's newest earlier run (config keys, tokenizer,
    shards, upstream), read from the identities saved beside the runs."""
    earlier = [
        key
        for _, key in store.keys("identity", stage)
        if not key.startswith(planned.base_key + "-") and ("@" in key) == ("@" in planned.base_key)
    ]
    if not earlier:
        return None
    previous = store.read_json("identity", stage, earlier[-1])["identity"]
    return {"run_key": earlier[-1], "inputs": identity.changed_inputs(previous, planned.identity)}

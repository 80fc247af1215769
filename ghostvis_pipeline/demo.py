"""`ghostvis demo`: materialize the whole graph on the embedded data, persisted in the Dagster
instance (DAGSTER_HOME) and the MLflow store, then print a per-asset breakdown."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from dagster import DagsterInstance

from ghostvis_core.errors import GhostvisError
from ghostvis_core.home import Home
from ghostvis_core.plan import selected
from ghostvis_core.store import Store
from ghostvis_pipeline.assets.data import tokenizer_kept
from ghostvis_pipeline.check_failures import check_failure_error, failed_check_lines
from ghostvis_pipeline.definitions import defs
from ghostvis_pipeline.environment import prepare_environment
from ghostvis_pipeline.partitions import shard_partitions

# Dagster 1.13 has no public API to run a partition range in process (execute_in_process takes one
# partition_key), so a single-run range is selected by its documented run tags, the ones
# `dagster asset materialize --partition-range` sets; dagster only exports them from a private module.
PARTITION_RANGE_START_TAG = "dagster/asset_partition_range_start"
PARTITION_RANGE_END_TAG = "dagster/asset_partition_range_end"


@dataclass
class RunSummary:
    run_id: str
    assets: dict[str, float] = field(default_factory=dict)  # asset -> seconds
    checks: list[tuple[str, str, bool]] = field(default_factory=list)  # (asset, check, passed)
    cached: set[str] = field(default_factory=set)  # assets that returned an earlier result (metadata cached_from)


def materialize(
    defs,
    instance,
    assets: list[str],
    *,
    partition_range: tuple[str, str] | None = None,
    run_config: dict[str, Any] | None = None,
) -> RunSummary:
    """One Dagster run of the implicit asset job for `assets` (and their checks), like
    `dagster asset materialize --select ...`, recorded in the instance."""
    from dagster import AssetKey, DagsterError

    keys = [AssetKey(a) for a in assets]
    job = defs.resolve_implicit_job_def_def_for_assets(keys)
    tags = {"ghostvis/demo": "true"}
    if partition_range:
        tags |= {PARTITION_RANGE_START_TAG: partition_range[0], PARTITION_RANGE_END_TAG: partition_range[1]}
    run_id = str(uuid.uuid4())  # a Dagster run id, known before the run: its events name a failed check
    try:
        result = job.execute_in_process(
            instance=instance,
            asset_selection=keys,
            tags=tags,
            run_config=run_config or {},
            raise_on_error=True,
            run_id=run_id,
        )
    except DagsterError:  # a blocking check's failure (Dagster's error names only the checks): what they found
        failed = failed_check_lines(instance, run_id)
        if not failed:
            raise
        raise check_failure_error(failed, run_id) from None
    summary = RunSummary(result.run_id)
    starts: dict[str, float] = {}
    for entry in instance.all_logs(result.run_id):
        ev = entry.dagster_event
        if ev is None or ev.step_key is None:
            continue
        if ev.event_type_value == "STEP_START":
            starts[ev.step_key] = entry.timestamp
        elif ev.event_type_value == "STEP_SUCCESS" and ev.step_key in starts:
            summary.assets[ev.step_key] = entry.timestamp - starts[ev.step_key]
    for ev in result.get_asset_check_evaluations():
        summary.checks.append((ev.asset_key.to_user_string(), ev.check_name, ev.passed))
    for ev in result.get_asset_materialization_events():
        if "cached_from" in ev.materialization.metadata:
            summary.cached.add(ev.asset_key.to_user_string())
    return summary


def materialize_data(
    instance, store: Store, preset: str, tokenizer: dict | None = None, retrain: bool = False
) -> list[RunSummary]:
    """raw_shards and tokenized_shards over every registered shard partition (one run each, here),
    the tokenizer in between (trained for the preset, or `tokenizer`: its run config, e.g. from_model) and
    the token ledger after; unchanged shards are skipped. A trained tokenizer whose training data alone changed
    is kept (`tokenizer_kept`): only the changed shards are tokenized, with it; `retrain` trains a new one."""
    keys = instance.get_dynamic_partitions(shard_partitions.name)
    if not keys:
        raise GhostvisError("no shard partitions are registered; materialize shard_manifest with your sources first")
    span = (keys[0], keys[-1])
    runs = [materialize(defs, instance, ["raw_shards"], partition_range=span)]
    if tokenizer or retrain or not tokenizer_kept(instance, store, preset):
        config = tokenizer or {"preset": preset}
        runs.append(materialize(defs, instance, ["tokenizer"], run_config={"ops": {"tokenizer": {"config": config}}}))
    return [
        *runs,
        materialize(defs, instance, ["tokenized_shards"], partition_range=span),
        materialize(defs, instance, ["token_ledger"]),
    ]


def run_demo(home: Home, preset: str, stages: list[str]) -> list[RunSummary]:
    prepare_environment(home)
    instance = DagsterInstance.get()
    runs = [materialize(defs, instance, ["shard_manifest"]), *materialize_data(instance, home.store, preset)]
    stage_config = {"ops": {s: {"config": {"preset": preset}} for s in stages}}
    runs.append(materialize(defs, instance, stages, run_config=stage_config))
    if list(stages) == selected.lineage().stage_names():  # the whole lineage: score it, write its report card
        runs.append(materialize(defs, instance, ["evaluation", "report"]))
    return runs


def format_summary(runs: list[RunSummary], wall: float) -> str:
    lines = [f"{'asset':<22} {'seconds':>8}  (checks)"]
    for r in runs:
        check_steps = {f"{a}_{c}": a for a, c, _ in r.checks}
        check_secs: dict[str, float] = {}
        for step, secs in r.assets.items():
            if step in check_steps:
                check_secs[check_steps[step]] = check_secs.get(check_steps[step], 0.0) + secs
        for step, secs in r.assets.items():
            if step not in check_steps:
                extra = f"  (+{check_secs[step]:.1f})" if step in check_secs else ""
                extra += "  cached" if step in r.cached else ""
                lines.append(f"{step:<22} {secs:>8.1f}{extra}")
    lines.append(f"{'total (wall)':<22} {wall:>8.1f}")
    checks = [c for r in runs for c in r.checks]
    failed = [c for c in checks if not c[2]]
    lines.append(
        f"checks: {len(checks) - len(failed)}/{len(checks)} passed"
        + ("" if not failed else "; FAILED: " + ", ".join(f"{a}:{n}" for a, n, _ in failed))
    )
    return "\n".join(lines)


def timed_demo(home: Home, preset: str, stages: list[str]) -> tuple[list[RunSummary], float]:
    t0 = time.time()
    runs = run_demo(home, preset, stages)
    return runs, time.time() - t0

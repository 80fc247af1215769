"""The `replay_matches` check: K of a run's checkpoint intervals (seeded, the last always among them), each
replayed in a process of its own (worker.py), each compared bit for bit with the checkpoint after it. The
verdict is kept in the store (record.py), where the report card reads it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

from ghostvis_core.store import Store
from ghostvis_core.verify.audit.check_outcome import CheckOutcome
from ghostvis_core.verify.audit.invariants import StageRun
from ghostvis_core.verify.replay.intervals import Interval, choose, intervals, kept_steps
from ghostvis_core.verify.replay.record import read_record, write_record
from ghostvis_core.verify.replay.refusal import refusal
from ghostvis_core.verify.replay.settings import ReplaySettings

NAME = "replay_matches"
HEADER = ["interval", "from", "result", "first differing tensor", "differing / compared", "largest difference", "s"]
NOT_REPLAYED = "not replayed"  # the result of an interval whose replay process failed


def run_worker(store: Store, stage: str, run_key: str, interval: Interval) -> dict[str, Any]:
    """One interval replayed in its own process; its result, with the process's wall time."""
    started = time.perf_counter()
    command = [sys.executable, "-m", "ghostvis_core.verify.replay.worker", store.uri]
    proc = subprocess.run(
        [*command, stage, run_key, str(interval.first), str(interval.last)], capture_output=True, text=True
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        error = f"the replay process exited with code {proc.returncode}: {' | '.join(tail)}"
        return {"first": interval.first, "last": interval.last, "error": error}
    return {**json.loads(lines[-1]), "process_s": round(time.perf_counter() - started, 2)}


def row(r: dict[str, Any]) -> list[Any]:
    start = "starting weights" if r["first"] == 1 else f"step {r['first'] - 1}"
    where = [f"steps {r['first']}..{r['last']}", start]
    if "error" in r:
        return [*where, NOT_REPLAYED, "-", "-", "-", "-"]
    largest = r["largest_difference"]
    return [
        *where,
        "bitwise equal" if r["bitwise_equal"] else "DIFFERS",
        r["first_differing"] or "-",
        f"{r['differing']} / {r['tensors_compared']}",
        "-" if largest is None else f"{largest[1]:.3g} ({largest[0]})",
        r["process_s"],
    ]


def failure(stage: str, run_key: str, r: dict[str, Any]) -> str | None:
    where = f"{stage} run {run_key} interval steps {r['first']}..{r['last']}"
    if "error" in r:
        return f"{where}: {r['error']}"
    if r["bitwise_equal"]:
        return None
    name, diff = r["largest_difference"]
    start = "the starting weights" if r["first"] == 1 else f"checkpoint step {r['first'] - 1}"
    return (
        f"{where}: the replay from {start} differs from checkpoint step {r['last']}: "
        f"first differing tensor {r['first_differing']}, "
        f"{r['differing']} of {r['tensors_compared']} tensors differ, largest difference {diff:.3g} in {name}"
    )


def no_interval(stage: str, run_key: str, available: int, k: int) -> str:
    if available:
        return f"{stage} run {run_key}: {k} intervals asked for; replay at least 1 (of {available})"
    return f"{stage} run {run_key}: no committed checkpoint to replay up to; re-materialize `{stage}`"


def figures(run: StageRun, available: int, results: list[dict[str, Any]], seed: int) -> dict[str, Any]:
    """The verdict's figures: intervals, bitwise-equal ones, and the cost per replayed step vs per training step."""
    done = [r for r in results if "error" not in r]
    equal = sum(r["bitwise_equal"] for r in done)
    steps = sum(r["last"] - r["first"] + 1 for r in done)
    batch = run.record.batch
    train_s = batch.tokens_per_step / run.record.tokens_per_sec if run.record.tokens_per_sec else None
    spans = ", ".join(f"{r['first']}..{r['last']}" for r in results)
    summary = f"{len(results)} interval{'s' * (len(results) != 1)} replayed (steps {spans}), "
    summary += "bitwise equal" if results and equal == len(results) else f"{equal} bitwise equal"
    return {
        "summary": summary,
        "intervals_available": available,
        "intervals_replayed": len(results),
        "intervals_bitwise_equal": equal,
        "seed": seed,
        "steps_replayed": steps,
        "replay_s_per_step": round(sum(r["steps_s"] for r in done) / steps, 4) if steps else None,
        "replay_process_s_per_step": round(sum(r["process_s"] for r in done) / steps, 4) if steps else None,
        "train_s_per_step": None if train_s is None else round(train_s, 4),
    }


def replay_matches(store: Store, run: StageRun, settings: ReplaySettings) -> CheckOutcome:
    """K intervals of the run replayed and compared (or the reason it cannot be replayed bit for bit); the
    verdict is also written to the store for the report card."""
    stage, key = run.spec.stage, run.spec.run_key
    why = refusal(run)
    if why is not None:
        outcome = CheckOutcome(
            NAME,
            False,
            figures={"summary": "not replayable bit for bit", "intervals_replayed": 0},
            failures=[f"{stage} run {key} cannot be replayed bit for bit: {why}"],
        )
    else:
        candidates = intervals(kept_steps(store, stage, key, run.chain))
        results = [run_worker(store, stage, key, i) for i in choose(candidates, settings.intervals, settings.seed)]
        failures = [f for f in (failure(stage, key, r) for r in results) if f]
        if not results:
            failures = [no_interval(stage, key, len(candidates), settings.intervals)]
        outcome = CheckOutcome(
            NAME,
            not failures,
            figures=figures(run, len(candidates), results, settings.seed),
            tables={"intervals": (HEADER, [row(r) for r in results])},
            failures=failures,
        )
    write_record(store, stage, key, outcome.to_dict())
    return outcome


def kept_verdict(store: Store, run: StageRun, settings: ReplaySettings) -> CheckOutcome | None:
    """The verdict an earlier replay of this very run left in the store with these settings (the same seed, as
    many intervals), for a cache hit: the run, its checkpoints and its rows are those already replayed, so
    replaying them again would only repeat the work. None when there is none to keep, or when an interval's
    replay process failed (that interval was never compared: it is replayed again)."""
    kept = read_record(store, run.spec.stage, run.spec.run_key)
    if kept is None or kept["figures"].get("seed") != settings.seed:
        return None
    figures = kept["figures"]
    if figures["intervals_replayed"] != min(settings.intervals, figures["intervals_available"]):
        return None
    if figures["intervals_replayed"] != len([r for r in kept["tables"]["intervals"]["rows"] if r[2] != NOT_REPLAYED]):
        return None
    tables = {name: (t["header"], t["rows"]) for name, t in kept["tables"].items()}
    figures = {**figures, "summary": f"{figures['summary']} (kept from the run's first replay: a cache hit)"}
    return CheckOutcome(NAME, kept["passed"], figures=figures, tables=tables, failures=kept["failures"])


def add_replays(store: Store, report: dict[str, Any], settings: ReplaySettings) -> None:
    """`ghostvis audit --replay K`: each audited stage's replay appended to its checks and the failures."""
    from ghostvis_core.data.ledger import Ledger

    ledger = Ledger.in_store(store)
    for result in report["stages"]:
        stage, key = result["stage"], result["run_key"]
        outcome = replay_matches(store, StageRun.load(store, ledger, stage, key), settings)
        result["checks"].append(outcome.to_dict())
        result["passed"] = result["passed"] and outcome.passed
        report["failures"] += [f"{stage}: {NAME}: {f}" for f in outcome.failures]

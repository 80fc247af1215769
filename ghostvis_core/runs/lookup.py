"""Finding runs in the store: completed runs of a stage, the upstream a stage starts from, run keys."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ghostvis_core.errors import GhostvisError
from ghostvis_core.runs.run_result import RunResult
from ghostvis_core.store import Store
from ghostvis_core.store.fence import is_committed


@dataclass(frozen=True)
class Upstream:
    """The checkpoint a stage starts from, and the run that wrote it."""

    stage: str
    run_key: str
    checkpoint: str


def checkpoint_key(uri: str) -> tuple[str, str, str]:
    """The store key (stage, run_key, step folder) of the checkpoint at `uri`
    (.../checkpoints/<stage>/<run_key>/<step>):
    the key, not the place, names a checkpoint, so a moved store or another node finds it too."""
    stage, run_key, step = uri.rstrip("/").split("/")[-3:]
    return stage, run_key, step


def checkpoint_of(store: Store, uri: str) -> Path:
    """The local folder of the checkpoint at `uri`, fetched from the store by its key."""
    return store.fetch("checkpoint", *checkpoint_key(uri))


def completed_runs(store: Store, stage: str) -> list[RunResult]:
    """Finished runs of a stage (not of its variants), oldest first."""
    keys = [key for _, key in store.keys("run_record", stage) if "@" not in key]
    return [run_result(store, stage, key) for key in keys if completed(store, stage, key)]


def newest_completed_run(store: Store, stage: str) -> RunResult | None:
    """The stage's newest finished run (what a stage name means: the upstream a stage starts from, the
    model evaluation loads, the run the audit and `ghostvis ledger --run <stage>` read), or None."""
    runs = completed_runs(store, stage)
    return runs[-1] if runs else None


def completed(store: Store, stage: str, run_key: str) -> bool:
    """The run's record is in the store and was committed under the run's lease (a record left by a launch that
    lost the lease is not the run's: store/fence.py)."""
    return is_committed(store, stage, identity_of(run_key), "run_record", stage, run_key)


def run_result(store: Store, stage: str, run_key: str) -> RunResult:
    if not completed(store, stage, run_key):
        raise GhostvisError(f"stage {stage} run {run_key} has not completed; materialize the `{stage}` asset")
    return RunResult.from_dict(store.read_json("run_record", stage, run_key))


def find_upstream(store: Store, stage: str) -> Upstream:
    newest = newest_completed_run(store, stage)
    if newest is None:
        raise GhostvisError(f"upstream stage '{stage}' has no completed run; materialize the `{stage}` asset first")
    return Upstream(stage, newest.run_key, newest.checkpoint_uri)


def attempts(store: Store, stage: str, base: str) -> list[tuple[int, str]]:
    """(n, run key) of every attempt base-r<n> of one run identity that wrote a checkpoint folder, oldest first."""
    found = []
    for _, key in store.keys("checkpoints", stage):
        m = re.fullmatch(re.escape(base) + r"-r(\d+)", key)
        if m:
            found.append((int(m.group(1)), key))
    return sorted(found)


def completed_attempts(store: Store, stage: str, base: str) -> list[str]:
    """Run keys of the finished attempts of one run identity, newest first: what a cache hit may reuse."""
    return [key for _, key in reversed(attempts(store, stage, base)) if completed(store, stage, key)]


def identity_of(run_key: str) -> str:
    """The run identity (base key) of an attempt's run key base-r<n>: what a run's lease is named by."""
    return run_key.rsplit("-r", 1)[0]


def next_run_key(store: Store, stage: str, base: str) -> str:
    """base-r<n>: the newest unfinished attempt is resumed; after a finished one, a new attempt starts."""
    found = attempts(store, stage, base)
    if not found:
        return f"{base}-r1"
    n, key = max(found)
    return f"{base}-r{n}" if not completed(store, stage, key) else f"{base}-r{n + 1}"

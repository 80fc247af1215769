"""Why a run failed, one record per failing rank (artifact run_error: stage, run_key, rank), so that
rank 1's follow-on error ("Connection closed by peer") never hides rank 0's root cause ("No space
left on device"). The run's reason is the first failure in time, with its rank and host; the other
ranks' follow.

A record also says whether its failure is a fault (`fault`: a killed rank, a lost node, a hang, an
exception nobody foresaw), which a retry from the newest checkpoint may get past, or a problem of the
run's inputs or settings that the job itself named (a GhostvisError: a token block that does not match
its digest, a checkpoint that fails its verification, a pre-flight refusal), which every retry would
meet again: the launching side ends the run once with its message (`input_problem`)."""

from __future__ import annotations

import socket
from datetime import datetime, timezone

from ghostvis_core.store import Store

# The first word of a rank's reason when the job stopped on purpose: told to stop and saved (train/preemption.py,
# resumed by the launcher without using up a retry), or ended by its progress watchdog (train/watchdog.py).
PREEMPTED = "preempted"
HUNG = "hung"
# ... or because another launch took its lease over (store/fence.py): it committed nothing after the loss, and is
# never retried as a fault (the launch that holds the lease now goes on with the run).
LEASE_LOST = "lease lost"
LEASE_LOST_EXIT = 77  # EX_NOPERM: this launch no longer has the right to write the run


def record_reason(store: Store, stage: str, run_key: str, rank: int, reason: str, *, fault: bool = True) -> None:
    """Rank `rank`'s reason with its host and time (UTC, ISO 8601); a rank's first reason is kept. `fault=False`:
    a problem of the run's inputs or settings (retrying cannot help)."""
    if store.exists("run_error", stage, run_key, str(rank)):
        return
    store.write_json(
        "run_error",
        stage,
        run_key,
        str(rank),
        data={
            "rank": rank,
            "host": socket.gethostname(),
            "time": datetime.now(timezone.utc).isoformat(),
            "reason": reason,
            "fault": fault,
        },
    )


def rank_reasons(store: Store, stage: str, run_key: str) -> list[dict]:
    """Every failing rank's record, first failure first."""
    records = [store.read_json("run_error", *key) for key in store.keys("run_error", stage, run_key)]
    return sorted(records, key=lambda r: (r["time"], r["rank"]))


def run_reason(store: Store, stage: str, run_key: str) -> str | None:
    """The run's reason: the first failure (rank, host, reason), then the other ranks' one per line; None
    when no rank left one."""
    records = rank_reasons(store, stage, run_key)
    if not records:
        return None
    lines = [f"rank {r['rank']} on {r['host']} at {r['time']}: {r['reason']}" for r in records]
    if len(lines) == 1:
        return lines[0]
    return lines[0] + "\nthen " + "\nthen ".join(lines[1:])


def clear_reasons(store: Store, stage: str, run_key: str) -> None:
    """An earlier attempt's reasons are not this one's."""
    for key in store.keys("run_error", stage, run_key):
        store.delete("run_error", *key)


def lost_lease(store: Store, stage: str, run_key: str) -> str | None:
    """The reason of a job that stopped because another launch took its lease over, or None."""
    records = rank_reasons(store, stage, run_key)
    return next((r["reason"] for r in records if r["reason"].startswith(LEASE_LOST)), None)


def input_problem(store: Store, stage: str, run_key: str) -> str | None:
    """The first reason that a rank recorded as no fault (a problem of the run's inputs or settings), with its
    rank and host, or None: a run that stopped for it is not retried (the same inputs stop it again)."""
    found = next((r for r in rank_reasons(store, stage, run_key) if r.get("fault") is False), None)
    return None if found is None else f"rank {found['rank']} on {found['host']}: {found['reason']}"


def was_preempted(store: Store, stage: str, run_key: str) -> bool:
    """The job stopped because it was preempted (every failing rank says so), not for a fault."""
    records = rank_reasons(store, stage, run_key)
    return bool(records) and all(r["reason"].startswith(PREEMPTED) for r in records)

"""The audit's row index of a run: per planned global row of each part of its chain, the step, rank and
micro-batch the row rule puts it at and every shard span it reads (tokens and raw rows), rebuilt from
the launch spec and the token files (rebuild.py) and written to the ledger (table `row_index`, one file
per part, sorted by shard).

`ghostvis trace` answers from it and the ledger's tables alone: which steps read a document is one
filtered read of the covering parts' index files, what a step fed one read of its part's; no token file
of the run is opened. The content proof (content.py) writes the index of the run it has just proved,
from the rows it rebuilt; a run traced before its checks ran gets its index written then.
"""

from __future__ import annotations

from typing import Any

from ghostvis_core.data.ledger import Ledger
from ghostvis_core.plan.batch import BatchPlan
from ghostvis_core.store import Store
from ghostvis_core.verify.audit.rebuild import PlannedRows


def place(g: int, plan: BatchPlan) -> dict[str, int]:
    """Step, rank and micro-batch of global row g (the row rule)."""
    o = g % plan.rows_per_step
    across = plan.world_size * plan.micro_batch_size
    return {
        "step": g // plan.rows_per_step + 1,
        "rank": (o % across) // plan.micro_batch_size,
        "micro_batch": o // across,
    }


def part_index(planned: PlannedRows, part: dict[str, Any]) -> list[dict[str, Any]]:
    """The index rows of one part: each of its global rows' spans, placed by the row rule with the
    part's own batch factors (a relaunch may change the world size)."""
    out, plan = [], BatchPlan.of(part)
    for g in range(part["rows_first"], part["rows_last"]):
        where = place(g - part["rows_first"], plan)
        where["step"] += part["step_first"] - 1
        for sp in planned.spans(g):
            first, last = planned.token_file(sp.shard_id).rows_of(sp.tok_start, sp.tok_end)
            out.append(
                {
                    **where,
                    "global_row": g,
                    "shard_id": sp.shard_id,
                    "epoch": sp.epoch,
                    "tok_start": sp.tok_start,
                    "tok_end": sp.tok_end,
                    "row_start": first,
                    "row_end": last,
                }
            )
    return out


def write_row_index(
    store: Store, ledger: Ledger, spec: dict[str, Any], parts: list[dict[str, Any]], planned: PlannedRows | None = None
) -> int:
    """Write the index of those of the run's `parts` that have none (rebuilding the plan's rows only when
    one is missing and `planned` is not given); returns how many parts were indexed."""
    missing = [p for p in parts if not ledger.has_row_index(p)]
    if missing:
        planned = planned or PlannedRows(store, spec)
        for part in missing:
            ledger.write_row_index(part, part_index(planned, part))
    return len(missing)

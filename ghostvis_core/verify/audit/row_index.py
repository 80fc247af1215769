"""The audit's row index of a run: per planned global row of its chain, its part and segment, the step,
rank and micro-batch the row rule puts it at and every shard span it reads (tokens and raw rows),
rebuilt from the launch spec and the token files (rebuild.py) and written to the ledger (table
`row_index`: one file per run, named as the head part of the chain it indexes, sorted by shard).

`ghostvis trace` answers from it and the ledger's tables alone: which steps read a document is one
filtered read of every run's index file (a file per run, row groups skipped by the shard's statistics),
what a step fed one read of its run's; no token file of a run is opened. The content proof (content.py)
writes the index of the chain it has just proved, from the rows it rebuilt; a run traced before its
checks ran, or whose chain grew since, gets its index written then.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.ledger.records import PartRow, RowIndexRow
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


def part_index(planned: PlannedRows, part: PartRow) -> list[RowIndexRow]:
    """The index rows of one part: each of its global rows' spans, placed by the row rule with the
    part's own batch factors (a relaunch may change the world size)."""
    out, plan = [], part.batch
    keys = (part.part_id, part.run_key, part.stage, part.segment)
    for g in range(part.rows_first, part.rows_last):
        where = place(g - part.rows_first, plan)
        at = (where["step"] + part.step_first - 1, where["rank"], where["micro_batch"], g)
        for sp in planned.spans(g):
            rows = planned.token_file(sp.shard_id).rows_of(sp.tok_start, sp.tok_end)
            out.append(RowIndexRow(*keys, *at, sp.shard_id, sp.epoch, sp.tok_start, sp.tok_end, *rows))
    return out


def write_row_index(
    store: Store, ledger: Ledger, spec: dict[str, Any], chain: list[PartRow], planned: PlannedRows | None = None
) -> Path | None:
    """The row index of the run's `chain`, written when the ledger has none for its head (rebuilding the
    plan's rows only then, when `planned` is not given); its file, None for an empty chain."""
    if not chain:
        return None
    index = ledger.row_index_file(ledger.part_file("parts", chain[-1]))
    if not index.is_file():
        planned = planned or PlannedRows(store, spec)
        ledger.write_row_index(chain, [r for part in chain for r in part_index(planned, part)])
    return index

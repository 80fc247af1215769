"""What the plan says a run had to read, and whether it did.

From the launch spec (steps, tokens_per_step's factors, mixture, where each source starts) and the
ledger's shard sizes, the rows [0, steps x rows_per_step) are mapped to their sources and to shard
token ranges by the stage's row rule; the ranges the ledger recorded must be exactly those: a gap,
a range read twice or an unexpected range (a resume that started in the wrong place shows as all
three) fails with the ranges. Each rank's share of each part must be exactly the rows the row rule
gives that rank for those steps. The rows come from rebuild.py, the audit's own code, never the loader's.
"""

from __future__ import annotations

from typing import Any

from ghostvis_core.counts import TokenCounts
from ghostvis_core.data.ledger.records import ConsumptionRow, PartRow, ShareRow
from ghostvis_core.data.ledger.write import row_ranges
from ghostvis_core.runs.launch_spec import LaunchSpec
from ghostvis_core.store import Store
from ghostvis_core.verify.audit.check_outcome import covered_twice, length, subtract, union
from ghostvis_core.verify.audit.rebuild import PlannedRows, Span, micro_rows


def rows_per_step(spec: LaunchSpec) -> int:
    return spec.plan.batch.rows_per_step


def expected_pieces(store: Store, spec: LaunchSpec) -> list[Span]:
    """The shard spans the plan's rows read (windows: one stream range per source; documents: the rows
    the stage's rule packs), rebuilt from the token files by the audit's own row rule."""
    n_rows = spec.plan.steps * rows_per_step(spec)
    return PlannedRows(store, spec.to_dict()).spans_before(n_rows)


def compare_ranges(expected: list[Span], recorded: list[ConsumptionRow]) -> list[list[Any]]:
    """[kind, shard, epoch, range, tokens] for every gap (expected, not recorded), range read twice, and
    unexpected range (recorded, not expected), per (shard, epoch)."""
    want: dict[tuple[str, int], list[tuple[int, int]]] = {}
    got: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for p in expected:
        want.setdefault((p.shard_id, p.epoch), []).append((p.tok_start, p.tok_end))
    for r in recorded:
        got.setdefault((r.shard_id, int(r.epoch)), []).append((int(r.tok_start), int(r.tok_end)))
    out = []
    for key in sorted(set(want) | set(got)):
        w, g = want.get(key, []), got.get(key, [])
        for kind, ranges in (("gap", subtract(w, g)), ("read twice", covered_twice(g)), ("unexpected", subtract(g, w))):
            out += [[kind, key[0], key[1], f"{a}..{b}", b - a] for a, b in ranges]
    return out


def expected_tokens(expected: list[Span]) -> int:
    by: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for p in expected:
        by.setdefault((p.shard_id, p.epoch), []).append((p.tok_start, p.tok_end))
    return sum(length(union(r)) for r in by.values())


def part_row_problems(chain: list[PartRow], spec: LaunchSpec) -> list[str]:
    """The chain's parts must tile steps 1..steps and rows [0, steps x rows_per_step) in order."""
    out, step, row, per_step = [], 1, 0, rows_per_step(spec)
    for p in chain:
        if (p.step_first, p.rows_first) != (step, row):
            out.append(
                f"part {p.part_id} starts at step {p.step_first}, row {p.rows_first}; "
                f"the previous part ended before step {step}, row {row}"
            )
        if p.rows_last - p.rows_first != (p.step_last - p.step_first + 1) * per_step:
            out.append(
                f"part {p.part_id}: rows {p.rows_first}..{p.rows_last} for steps "
                f"{p.step_first}..{p.step_last} ({per_step} rows per step)"
            )
        step, row = p.step_last + 1, p.rows_last
    steps = spec.plan.steps
    if (step - 1, row) != (steps, steps * per_step):
        out.append(
            f"the chain ends after step {step - 1}, row {row}; the plan is {steps} steps, {steps * per_step} rows"
        )
    return out


def rank_rows(part: PartRow, rank: int, per_step: int) -> list[list[int]]:
    """The global rows rank `rank` reads in the part's steps, as [start, end) ranges."""
    batch = part.batch
    rows = [
        g
        for s in range(part.step_first, part.step_last + 1)
        for m in range(batch.grad_accum_steps)
        for g in micro_rows((s - 1) * per_step, m, rank, batch.micro_batch_size, batch.world_size)
    ]
    return row_ranges(rows)


def share_problems(part: PartRow, shares: list[ShareRow], per_step: int) -> list[list[Any]]:
    """[part, rank, expected rows, recorded rows, problem] for each rank whose share is missing, holds
    other rows, or whose figures do not sum to the part's."""
    out = []
    by_rank = {s.rank: s for s in shares}
    for rank in range(part.world_size):
        want = rank_rows(part, rank, per_step)
        got = by_rank.get(rank)
        if got is None:
            out.append([part.part_id, rank, _fmt(want), "none", "no share recorded"])
        elif got.row_ranges != want:
            out.append([part.part_id, rank, _fmt(want), _fmt(got.row_ranges), "other rows"])
    total = TokenCounts.total(s.counts for s in shares)
    if shares and total != part.counts:
        out.append(
            [
                part.part_id,
                "all",
                str(part.counts.as_list()),
                str(total.as_list()),
                "shares do not sum to the part's figures",
            ]
        )
    return out


def _fmt(ranges: list[list[int]]) -> str:
    text = ", ".join(f"{a}..{b}" for a, b in ranges[:8])
    return text + (f", ... ({len(ranges)} ranges)" if len(ranges) > 8 else "")

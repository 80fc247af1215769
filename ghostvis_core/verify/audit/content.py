"""Content proof: what every rank fed the model, step by step, equals the rows the plan says it had to
read, rebuilt from the token files by the audit's own code (rebuild.py).

The trainer records, per rank and step, each micro-batch's global rows, row digests, image hashes and
digest, and the step's fold of them (ledger table `feeds`). Here every micro-batch is rebuilt and
digested the same way (ghostvis_core/digest.py). A mismatch names the stage, step, rank, micro-batch and
row; when the fed row equals another row of the plan nearby (a row skipped, another trained twice, a
rewound resume), that row is named and the first position where the two differ. The rows rebuilt
are also written as the run's row index (row_index.py), which `ghostvis trace` reads.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ghostvis_core import digest
from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.ledger.records import FeedRow, PartRow
from ghostvis_core.plan.batch import BatchPlan
from ghostvis_core.store import Store
from ghostvis_core.verify.audit.check_outcome import CheckOutcome
from ghostvis_core.verify.audit.rebuild import PlannedRows, micro_rows
from ghostvis_core.verify.audit.row_index import write_row_index

SEARCH_STEPS = 2  # a fed row that is not its planned row is looked for this many steps either side


class StepAuditor:
    """Compares one run's feed records with its plan, caching the rows it rebuilds."""

    def __init__(self, rows: PlannedRows, plan: dict[str, Any], stage: str):
        self.rows, self.stage = rows, stage
        batch = BatchPlan.of(plan)
        self.mbs, self.world, self.accum = batch.micro_batch_size, batch.world_size, batch.grad_accum_steps
        self.per_step = batch.rows_per_step
        self.total_rows = int(plan["steps"]) * self.per_step
        self._digests: dict[int, str] = {}

    def digest_of(self, g: int) -> str:
        if g not in self._digests:
            self._digests[g] = self.rows.row(g).digest()
        return self._digests[g]

    def compare(self, feed: FeedRow) -> list[list[Any]]:
        """[step, rank, micro-batch, row, problem] for each way the record differs from the plan."""
        step, rank = feed.step, feed.rank
        where = [step, rank]
        out = []
        if digest.step_digest(feed.micro_digests) != feed.step_digest:
            out.append([*where, "-", "-", "the step digest is not the fold of its micro-batch digests"])
        if len(feed.micro_rows) != self.accum:
            out.append([*where, "-", "-", f"{len(feed.micro_rows)} micro-batches fed, the plan has {self.accum}"])
        first = (step - 1) * self.per_step
        for m, fed_rows in enumerate(feed.micro_rows[: self.accum]):
            want = micro_rows(first, m, rank, self.mbs, self.world)
            if fed_rows != want:
                out.append([*where, m, "-", f"recorded rows {_span(fed_rows)}, the plan's rows are {_span(want)}"])
                continue
            images = [d for g in want for d in self.rows.image_digests(g)]
            expected = digest.micro_digest([self.digest_of(g) for g in want], images)
            if expected != feed.micro_digests[m]:
                out.append([*where, m, *self.explain(want, feed.row_digests[m], feed.image_hashes[m], images, step)])
        return out

    def explain(
        self, want: list[int], fed: list[str], fed_images: list[str], images: list[str], step: int
    ) -> list[Any]:
        """The first differing row of a micro-batch, and what the model received instead."""
        for g, got in zip(want, fed):
            if got == self.digest_of(g):
                continue
            other = self.find(got, step)
            if other is None:
                return [g, f"row {g} as fed matches no row of the plan within {SEARCH_STEPS} steps of step {step}"]
            return [
                g,
                f"row {g} was recorded but row {other} was fed in its place ({first_difference(self.rows, g, other)})",
            ]
        if len(fed) != len(want):
            return ["-", f"{len(fed)} rows fed, the plan's micro-batch has {len(want)}"]
        return ["-", f"images fed {fed_images} differ from the rows' images {images}"]

    def find(self, row_digest: str, step: int) -> int | None:
        lo = max(0, (step - 1 - SEARCH_STEPS) * self.per_step)
        hi = min(self.total_rows, (step + SEARCH_STEPS) * self.per_step)
        return next((g for g in range(lo, hi) if self.digest_of(g) == row_digest), None)


def first_difference(rows: PlannedRows, g: int, other: int) -> str:
    a, b = rows.row(g), rows.row(other)
    for name in ("inputs", "targets"):
        x, y = getattr(a, name), getattr(b, name)
        diff = np.nonzero(x != y)[0]
        if len(diff):
            p = int(diff[0])
            return f"first differing position {p}: {name} {int(x[p])} in the files' row {g}, {int(y[p])} fed"
    return "the rows differ only in their document ids or images"


def _span(rows: list[int]) -> str:
    return f"{rows[0]}..{rows[-1] + 1}" if rows == list(range(rows[0], rows[0] + len(rows))) else str(rows)


def fed_content_matches_files(store: Store, ledger: Ledger, spec: dict[str, Any], chain: list[PartRow]) -> CheckOutcome:
    """Every rank's every step along the run's chain: a feed record exists, its rows are the plan's, and
    its digests equal those of the rows rebuilt from the token files."""
    auditor = StepAuditor(PlannedRows(store, spec), spec["plan"], spec["stage"])
    feeds = {(f.step, f.rank): f for f in ledger.feeds(chain)}
    problems: list[list[Any]] = []
    checked, fed = 0, 0
    for part in chain:
        for step in range(part.step_first, part.step_last + 1):
            for rank in range(auditor.world):
                feed = feeds.get((step, rank))
                if feed is None:
                    problems.append([step, rank, "-", "-", f"no content digests recorded (part {part.part_id})"])
                    continue
                problems += auditor.compare(feed)
                checked += 1
                fed += sum(len(rows) for rows in feed.micro_rows)
    write_row_index(store, ledger, spec, chain, auditor.rows)  # what `ghostvis trace` reads, from the rows rebuilt
    stage = spec["stage"]
    return CheckOutcome(
        "fed_content_matches_files",
        not problems and bool(chain),
        figures={
            "steps_checked": len({s for s, _ in feeds}),
            "rank_steps_checked": checked,
            "rows_rebuilt": len(auditor._digests),
            "rows_fed": fed,
            "problems": len(problems),
        },
        tables={"problems": (["step", "rank", "micro-batch", "row", "problem"], problems[:200])},
        failures=[f"{stage} step {s} rank {r} micro-batch {m}: {p}" for s, r, m, _, p in problems[:50]]
        or ([] if chain else ["the run has no part in the ledger"]),
    )

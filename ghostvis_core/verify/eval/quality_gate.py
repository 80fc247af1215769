"""The lineage quality gate: every stage's held-out bits per byte against the stage it starts from.

A stage that makes the language model much worse at plain text (SFT and DPO can: every accounting
check passes while the model forgets) should be flagged, not trusted. The evaluation scores every
stage on the same held-out shards; here each stage's bpb on each source is divided by its upstream's
(the stage table's `upstream`), and a ratio above 1 + the stage's tolerance is flagged. Tolerances
are declared in the stage table (`Stage.bpb_tolerance`, default BPB_TOLERANCE) and overridden per
evaluation (its config `bpb_tolerance`). Only bpb is gated: the multiple-choice and harness scores of
a tiny model move by chance at 25 items and are shown, not judged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ghostvis_core.errors import GhostvisError
from ghostvis_core.plan import selected, stages

GATE_HEADER = ["stage", "upstream", "source", "upstream bpb", "stage bpb", "ratio", "tolerance", "status"]


@dataclass(frozen=True)
class GateRow:
    """One stage, one held-out source: both sides of the comparison and the allowed worsening."""

    stage: str
    upstream: str
    source: str
    upstream_bpb: float
    stage_bpb: float
    tolerance: float  # allowed relative worsening: 0.10 = at most 10% more bits per byte

    @property
    def ratio(self) -> float:
        return self.stage_bpb / self.upstream_bpb

    @property
    def passed(self) -> bool:
        return self.ratio <= 1.0 + self.tolerance

    def cells(self) -> list:
        status = "ok" if self.passed else f"FLAGGED: {self.ratio - 1:+.1%} > {self.tolerance:.0%}"
        return [
            self.stage,
            self.upstream,
            self.source,
            round(self.upstream_bpb, 4),
            round(self.stage_bpb, 4),
            round(self.ratio, 4),
            self.tolerance,
            status,
        ]


def tolerances(overrides: dict[str, float] | None = None) -> dict[str, float]:
    """Each stage's tolerance: the stage table's, or the override given for it by name."""
    names = stages.stage_names()
    unknown = sorted(set(overrides or {}) - set(names))
    if unknown:
        raise GhostvisError(f"bpb_tolerance names unknown stage(s) {', '.join(unknown)}; stages: {', '.join(names)}")
    bad = {k: v for k, v in (overrides or {}).items() if v < 0}
    if bad:
        raise GhostvisError(
            f"bpb_tolerance {bad}: a tolerance is the allowed relative worsening (0.1 = 10%), so it cannot be negative"
        )
    return {s.name: float((overrides or {}).get(s.name, s.bpb_tolerance)) for s in stages.STAGES}


def gate_rows(bpb: dict[str, dict[str, float]], tolerance: dict[str, float]) -> list[GateRow]:
    """A row per scored stage whose upstream was scored too, and per source both were scored on
    (`bpb`: stage -> source -> bits per byte, as the evaluation records it); a stage's upstream is the one it
    starts from in the selected lineage."""
    rows, chain = [], selected.lineage()
    for name, scores in bpb.items():
        up = chain.upstream(name)
        if up is None or up not in bpb:
            continue
        rows += [
            GateRow(name, up, source, bpb[up][source], scores[source], tolerance[name])
            for source in sorted(set(scores) & set(bpb[up]))
        ]
    return rows


@dataclass(frozen=True)
class GateVerdict:
    """The gate over a lineage: every row (both sides), summary figures, and each flagged row in words."""

    passed: bool
    rows: list[GateRow]
    figures: dict[str, Any]
    failures: list[str]

    def table(self) -> tuple[list[str], list[list]]:
        return GATE_HEADER, [r.cells() for r in self.rows]


def lineage_gate(bpb: dict[str, dict[str, float]], tolerance: dict[str, float]) -> GateVerdict:
    """The gate's verdict: every row's both sides, the worst ratio, each flagged row named."""
    rows = gate_rows(bpb, tolerance)
    failures = [
        f"{r.stage}: {r.source} bpb {r.stage_bpb:.3f} is {r.ratio - 1:+.1%} against {r.upstream}'s "
        f"{r.upstream_bpb:.3f}, beyond its tolerance of {r.tolerance:.0%}; retune {r.stage} (lower its "
        f"learning rate or steps, replay pretraining text) or raise its tolerance (evaluation config "
        f"bpb_tolerance: {{{r.stage}: ...}})"
        for r in rows
        if not r.passed
    ]
    worst = max(rows, key=lambda r: r.ratio - r.tolerance, default=None)
    figures = {
        "compared": len(rows),
        "flagged": len(failures),
        "stages_flagged": ", ".join(sorted({r.stage for r in rows if not r.passed})) or "none",
    }
    if worst is not None:
        figures |= {
            "worst": f"{worst.stage} on {worst.source}",
            "worst_ratio": round(worst.ratio, 4),
            "worst_tolerance": worst.tolerance,
        }
    return GateVerdict(passed=not failures, rows=rows, figures=figures, failures=failures)

"""What a check found, with both sides of every comparison; and the interval arithmetic the checks share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CheckOutcome:
    """One check's verdict: `figures` are scalars (both sides of each comparison), `tables` name a
    header and rows (shown as Markdown in Dagster, as text by `ghostvis audit`), `failures` name each
    figure or range that disagrees, so a failure says what, not only that."""

    name: str
    passed: bool
    figures: dict[str, Any] = field(default_factory=dict)
    tables: dict[str, tuple[list[str], list[list[Any]]]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "passed": self.passed,
            "figures": self.figures,
            "failures": self.failures,
            "tables": {k: {"header": h, "rows": r} for k, (h, r) in self.tables.items()},
        }


def union(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, disjoint [start, end) ranges covering the same positions (touching ones joined)."""
    out: list[list[int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def subtract(ranges: list[tuple[int, int]], minus: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Positions of `ranges` not in `minus` (both as [start, end) lists)."""
    out, cut = [], union(minus)
    for a, b in union(ranges):
        pos = a
        for c, d in cut:
            if d <= pos or c >= b:
                continue
            if c > pos:
                out.append((pos, c))
            pos = max(pos, d)
        if pos < b:
            out.append((pos, b))
    return out


def covered_twice(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Positions that two or more of `ranges` cover (a range read twice)."""
    events = sorted([(a, 1) for a, _ in ranges] + [(b, -1) for _, b in ranges])
    out, depth, start = [], 0, 0
    for pos, step in events:
        if depth >= 2 and pos > start:
            out.append((start, pos))
        depth += step
        start = pos
    return union(out)


def length(ranges: list[tuple[int, int]]) -> int:
    return sum(b - a for a, b in ranges)

"""A recipe's row-level mixture schedule: which source each global row comes from. The planner splits a
budget with it and the loader follows it, so both agree row by row."""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from ghostvis_core.errors import GhostvisError


class MixtureSchedule:
    """Which source each global row comes from: a fixed interleaved pattern of `period` rows.

    Source i gets round(weight_i x period) rows of every period (largest-remainder rounding), spread
    evenly (smooth weighted round-robin). Any prefix of N rows then holds each source's count
    within one row of count_i/period x N, i.e. the weights rounded to 1/period (exact for weights
    that are multiples of 1/period, e.g. 0.7/0.3); and the number of rows of source i before
    global row g is O(1) arithmetic.
    """

    def __init__(self, weights: list[float], period: int = 1000):
        counts = _apportion(weights, period)
        pattern: list[int] = []
        credit = [0] * len(counts)
        for _ in range(period):
            for i, c in enumerate(counts):
                credit[i] += c
            best = max(range(len(counts)), key=lambda i: credit[i])
            credit[best] -= period
            pattern.append(best)
        self.period = period
        self.counts = counts
        self.pattern = np.array(pattern, dtype=np.int64)
        self._prefix = np.zeros((len(counts), period + 1), dtype=np.int64)
        for i in range(len(counts)):
            self._prefix[i, 1:] = np.cumsum(self.pattern == i)

    def locate(self, g: int) -> tuple[int, int]:
        """Global row g -> (source index, that source's row index)."""
        cycle, r = divmod(g, self.period)
        s = int(self.pattern[r])
        return s, cycle * self.counts[s] + int(self._prefix[s, r])

    def rows_before(self, g: int) -> list[int]:
        """Rows of each source among global rows [0, g)."""
        cycle, r = divmod(g, self.period)
        return [cycle * c + int(self._prefix[i, r]) for i, c in enumerate(self.counts)]


def _apportion(weights: list[float], period: int) -> list[int]:
    exact = [
        Fraction(w).limit_denominator(10**9) * period / sum(Fraction(x).limit_denominator(10**9) for x in weights)
        for w in weights
    ]
    counts = [int(e) for e in exact]
    for i in sorted(range(len(weights)), key=lambda i: exact[i] - counts[i], reverse=True)[: period - sum(counts)]:
        counts[i] += 1
    if any(c == 0 for c in counts):
        raise GhostvisError(f"mixture weights {weights}: a weight is below 1/{period}; raise it or drop the source")
    return counts

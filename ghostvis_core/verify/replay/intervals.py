"""A run's replayable intervals and the seeded choice of K of them.

An interval ends at a kept checkpoint (a committed step_* folder still in the store) and starts at the kept
checkpoint before it, or at step 0 (the run's starting weights: the upstream checkpoint or the seeded
initialisation) for the first one; pruned checkpoints in between are replayed through."""

from __future__ import annotations

import random
from dataclasses import dataclass

from ghostvis_core.data.ledger.records import PartRow
from ghostvis_core.store import Store
from ghostvis_core.store.layout import step_dir_name


@dataclass(frozen=True)
class Interval:
    """Optimizer steps first..last (1-based), from the checkpoint of step first - 1 (0: the starting weights)."""

    first: int
    last: int

    @property
    def name(self) -> str:
        return f"steps {self.first}..{self.last}"


def kept_steps(store: Store, stage: str, run_key: str, chain: list[PartRow]) -> list[int]:
    """The steps of the run's chain whose checkpoint is still committed in the store, in order."""
    ends = sorted({p.step_last for p in chain})
    return [s for s in ends if store.exists("checkpoint_marker", stage, run_key, step_dir_name(s))]


def intervals(kept: list[int]) -> list[Interval]:
    starts = [0, *kept[:-1]]
    return [Interval(a + 1, b) for a, b in zip(starts, kept) if b > a]


def choose(candidates: list[Interval], k: int, seed: int) -> list[Interval]:
    """K of the intervals, always the last one, the others drawn with Random(seed); in step order."""
    if not candidates or k <= 0:
        return []
    *others, last = candidates
    drawn = random.Random(seed).sample(others, min(k - 1, len(others)))
    return sorted([*drawn, last], key=lambda i: i.first)

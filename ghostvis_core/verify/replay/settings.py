"""The replay's settings, one owner for their defaults (the audit's --replay flags and the Dagster check's config)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReplaySettings:
    """How many checkpoint intervals of a run to replay (the last always among them), and the seed that
    draws the others."""

    intervals: int = 1
    seed: int = 0

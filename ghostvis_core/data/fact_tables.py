"""Shared fact tables, shipped as data files in ghostvis_core/resources.

The demo chat/preference data teaches these facts and the eval benchmark asks about them, so both
read the one table here rather than eval importing the demo data generator.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

RESOURCES = Path(__file__).resolve().parent.parent / "resources"


@cache
def capitals() -> tuple[tuple[str, str], ...]:
    """(country, capital) pairs in file order; tuples, so a pair compares equal to a picked pair."""
    pairs = json.loads((RESOURCES / "capitals.json").read_text(encoding="utf-8"))
    return tuple((country, city) for country, city in pairs)

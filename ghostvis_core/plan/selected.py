"""What the environment selects for a code location and a command: the preset (GHOSTVIS_PRESET) and the lineage
(GHOSTVIS_LINEAGE, else the preset's). Read when asked, never at import: tests and `ghostvis demo --preset` set
them per process; the Dagster code location reads them once, when it loads."""

from __future__ import annotations

import os

from ghostvis_core.plan.lineage import ENV, Lineage, parse

DEFAULT_PRESET = "tiny"
DEFAULT_LINEAGE = "vlm"
# A preset's lineage where it is not `vlm` (lineage.NAMED): the tiny demo starts rl on reasoning_mix.
PRESET_LINEAGES: dict[str, str] = {"tiny": "demo"}


def default_preset() -> str:
    """GHOSTVIS_PRESET, else tiny: what the Dagster assets and the CLI use unless told otherwise."""
    return os.environ.get("GHOSTVIS_PRESET", DEFAULT_PRESET)


def lineage() -> Lineage:
    """GHOSTVIS_LINEAGE, else the default preset's (PRESET_LINEAGES), else every stage (`vlm`)."""
    return parse(os.environ.get(ENV) or PRESET_LINEAGES.get(default_preset(), DEFAULT_LINEAGE))

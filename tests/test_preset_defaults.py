"""The README's table of what the presets set over the defaults is what the code resolves: each row's
default (the config dataclass's) and its tiny and smoke values (presets.resolve), stage by stage."""

from __future__ import annotations

import re
from pathlib import Path

from ghostvis_core.plan.config import StageConfig
from ghostvis_core.plan.presets import resolve

README = Path(__file__).resolve().parents[1] / "README.md"


def table_rows() -> list[list[str]]:
    text = README.read_text()
    block = text.split("<!-- preset-defaults:begin -->")[1].split("<!-- preset-defaults:end -->")[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in block.strip().splitlines()]
    return rows[2:]  # after the header and its rule


def value(text: str):
    """A table cell's value: `sft_dpo` -> "sft_dpo", `true` -> True."""
    raw = re.fullmatch(r"`([^`]*)`", text).group(1)
    return {"true": True, "false": False}.get(raw, raw)


def setting(cfg: StageConfig, dotted: str):
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


def default_of(stage: str, dotted: str):
    """The config dataclass's default: the section's class built with no arguments."""
    section, key = dotted.split(".")
    section_type = type(getattr(resolve(stage, "tiny"), section))
    return getattr(section_type(), key)


def test_the_readmes_preset_table_is_what_the_code_resolves():
    rows = table_rows()
    assert len(rows) == 6
    for name, stage, default, tiny, smoke, _why in rows:
        dotted = name.strip("`")
        assert value(default) == default_of(stage, dotted), (dotted, stage, "default")
        assert value(tiny) == setting(resolve(stage, "tiny"), dotted), (dotted, stage, "tiny")
        assert value(smoke) == setting(resolve(stage, "smoke"), dotted), (dotted, stage, "smoke")

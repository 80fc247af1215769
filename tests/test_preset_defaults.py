"""The README's table of what the presets set over the defaults is what the code resolves: each row's
default (the config dataclass's) and its tiny and smoke values (presets.resolve), stage by stage; and
`ghostvis plan --settings` says where each resolved setting comes from."""

from __future__ import annotations

import json
import re
from pathlib import Path

from ghostvis_core.plan.config import StageConfig, flatten
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


def test_plan_settings_says_where_each_setting_comes_from(capsys):
    from ghostvis_pipeline.cli import main

    argv = ["plan", "--preset", "tiny", "--stage", "dpo", "--settings", "--set", "budget.steps=4", "--json"]
    assert main(argv) == 0
    rows = {r["key"]: (r["value"], r["from"]) for r in json.loads(capsys.readouterr().out)}
    assert rows["dpo.loss"] == ("sft_dpo", "preset tiny")  # the preset's choice, said where the stage is planned
    assert rows["dpo.beta"] == (0.1, "default")
    assert rows["budget.steps"] == (4, "--set")
    assert rows["data.allow_repeat"] == (False, "default")
    assert rows["grpo"] == (None, "not used by this stage (objective dpo)")
    assert rows["init_from"] == ("sft", "the lineage")
    cfg = resolve("dpo", "tiny", {"budget.steps": 4})
    assert set(rows) == set(flatten(cfg.to_dict()))  # every setting, once

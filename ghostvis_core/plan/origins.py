"""Where each resolved setting of a stage comes from: a `--set` override, the preset's deltas for the stage, the
model shape, the stage table and lineage, or the config dataclass's default (`ghostvis plan --settings`), so a
preset's choice (tiny's `dpo.loss: sft_dpo`) is said where the stage is planned, not only in presets.py."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from ghostvis_core.plan import presets, run_modes
from ghostvis_core.plan.config import StageConfig, flatten

SECTIONS = {"vision", "dpo", "grpo"}  # a stage has these only when its objective or model uses them
TABLE_KEYS = {"stage": "the stage", "objective": "the stage table", "init_from": "the lineage", "preset": "--preset"}


def setting_origins(cfg: StageConfig, overrides: dict[str, Any]) -> list[tuple[str, Any, str]]:
    """(dotted key, value, origin) of every setting of the resolved `cfg`, in key order; `overrides` are the
    `--set` (and flag) values it was resolved with."""
    preset = run_modes.model_preset(cfg.preset)
    deltas = set(flatten(presets._stage_defaults(cfg.stage, preset)))
    defaults = section_defaults(cfg)
    out = []
    for key, value in sorted(flatten(cfg.to_dict()).items()):
        if key in overrides:
            origin = "--set"
        elif value is None and key in SECTIONS:
            origin = f"not used by this stage (objective {cfg.objective})"
        elif key in TABLE_KEYS:
            origin = TABLE_KEYS[key]
        elif key in deltas:
            origin = f"preset {cfg.preset}"
        elif key.startswith("model."):
            origin = f"preset {cfg.preset}'s model, as the stage it starts from has it"
        elif key in defaults and defaults[key] == value:
            origin = "default"
        else:
            origin = "derived (from the settings above)"
        out.append((key, value, origin))
    return out


def section_defaults(cfg: StageConfig) -> dict[str, Any]:
    """Each section's dataclass defaults as dotted keys in the config's JSON shape (`dpo.loss` -> "sigmoid"),
    for the sections cfg has; a field without a default (the model's shape) has none."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        if not dataclasses.is_dataclass(section):
            continue
        for field in dataclasses.fields(section):
            if field.default is not dataclasses.MISSING:
                value = field.default
            elif field.default_factory is not dataclasses.MISSING:
                value = field.default_factory()
            else:
                continue
            out.update(flatten({f"{f.name}.{field.name}": json.loads(json.dumps(as_json(value)))}))
    return out


def as_json(value: Any) -> Any:
    """A default value in the config's JSON shape: dataclasses as dicts, tuples as lists."""
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    if isinstance(value, tuple):
        return [as_json(v) for v in value]
    return value

"""Presets: the one source of truth for every default.

A preset names a model shape and, per stage, the batch, budget, optimiser and data recipe.
`resolve(stage, preset, overrides)` turns them into a validated StageConfig.

- tiny:  ~5M params, trains every stage on 2 CPU cores in minutes (the demo).
- smoke: the tiny model with fewer steps, for end-to-end tests.
- 500m / 1.5b / 7b: GPU-class shapes the planner prices (Chinchilla budgets by default).
"""

from __future__ import annotations

import os
from typing import Any

from ghostvis_core.config import StageConfig, apply_overrides
from ghostvis_core.errors import GhostvisError

STAGES = (
    "pretrain",
    "continued_pretrain",
    "context_expansion",
    "reasoning_mix",
    "vision_alignment",
    "sft",
    "dpo",
)

MODELS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=4096, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=688, max_seq_len=256),
    "500m": dict(vocab_size=65536, d_model=1280, n_layers=24, n_heads=10, n_kv_heads=5, ffn_hidden=3456, max_seq_len=2048),
    "1.5b": dict(vocab_size=65536, d_model=2048, n_layers=24, n_heads=16, n_kv_heads=8, ffn_hidden=5632, max_seq_len=4096),
    "7b": dict(vocab_size=65536, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336, max_seq_len=4096),
}

# Tokenizer vocabulary (including special tokens) trained for each preset; the model's vocab_size
# is set from the trained tokenizer at launch, this is what the tokenizer asset aims for.
TOKENIZER_VOCAB = {"tiny": 4096, "smoke": 4096, "500m": 65536, "1.5b": 65536, "7b": 65536}

_DEMO_PRETRAIN = [{"source": "demo_prose", "weight": 0.5}, {"source": "demo_code", "weight": 0.5}]
_DEMO_VAL = ["demo_prose", "demo_code"]

# Stage defaults per preset: nested dicts merged over the StageConfig tree.
_TINY: dict[str, dict[str, Any]] = {
    "pretrain": dict(
        objective="lm",
        batch=dict(micro_batch_size=8, seq_len=256, world_size=2, grad_accum_steps=1),
        budget=dict(steps=150),
        optim=dict(lr=3e-3, warmup_steps=15, min_lr_ratio=0.1),
        data=dict(recipe=_DEMO_PRETRAIN, val_sources=_DEMO_VAL),
        eval=dict(every_steps=50, val_tokens=16384),
        checkpoint=dict(every_steps=50, keep_last=2),
    ),
}

_SMOKE_STEPS = {"pretrain": 24}

_LARGE_PRETRAIN = dict(
    objective="lm",
    batch=dict(micro_batch_size=8, seq_len=2048, world_size=8, total_batch_tokens=524288),
    budget=dict(tokens_per_param=20.0),
    optim=dict(lr=6e-4, warmup_steps=700, min_lr_ratio=0.1),
    data=dict(recipe=[{"source": "fineweb_edu", "weight": 1.0}], val_sources=["fineweb_edu"]),
    eval=dict(every_steps=500, val_tokens=10_485_760),
    checkpoint=dict(every_steps=1000, keep_last=3),
)


def default_preset() -> str:
    """GHOSTVIS_PRESET, else tiny: what the Dagster assets and the CLI use unless told otherwise."""
    return os.environ.get("GHOSTVIS_PRESET", "tiny")


def tokenizer_vocab(preset: str) -> int:
    model_for(preset)  # validates the name
    return TOKENIZER_VOCAB[preset]


def demo_stages() -> list[str]:
    """The stages the tiny preset has defaults for, in dependency order (what `ghostvis demo` trains)."""
    return [s for s in STAGES if s in _TINY]


def preset_names() -> list[str]:
    return ["tiny", "smoke", *[m for m in MODELS if m != "tiny"]]


def _stage_defaults(stage: str, preset: str) -> dict[str, Any]:
    if preset in ("tiny", "smoke"):
        if stage not in _TINY:
            raise GhostvisError(f"stage '{stage}' has no defaults in preset '{preset}' yet")
        base = _TINY[stage]
        if preset == "smoke":
            base = {**base, "budget": dict(steps=_SMOKE_STEPS[stage])}
            base["eval"] = dict(every_steps=12, val_tokens=8192)
            base["checkpoint"] = dict(every_steps=12, keep_last=2)
        return base
    if stage == "pretrain":
        return _LARGE_PRETRAIN
    raise GhostvisError(f"stage '{stage}' has no defaults in preset '{preset}' yet")


def model_for(preset: str) -> dict[str, Any]:
    if preset not in preset_names():
        raise GhostvisError(f"unknown preset '{preset}'; choose one of: {', '.join(preset_names())}")
    return dict(MODELS["tiny" if preset == "smoke" else preset])


def resolve(stage: str, preset: str = "tiny", overrides: dict[str, Any] | None = None) -> StageConfig:
    """Preset defaults + dotted overrides -> a validated StageConfig."""
    if stage not in STAGES:
        raise GhostvisError(f"unknown stage '{stage}'; stages are: {', '.join(STAGES)}")
    model = model_for(preset)
    defaults = _stage_defaults(stage, preset)
    base = StageConfig.from_dict({"stage": stage, "preset": preset, "model": model, **defaults}).to_dict()
    cfg = StageConfig.from_dict(apply_overrides(base, overrides or {}))
    validate(cfg)
    return cfg


def validate(cfg: StageConfig) -> None:
    b = cfg.batch
    for name in ("micro_batch_size", "seq_len", "world_size"):
        if getattr(b, name) <= 0:
            raise GhostvisError(f"batch.{name} must be positive, got {getattr(b, name)}")
    if b.seq_len > cfg.model.max_seq_len:
        raise GhostvisError(
            f"batch.seq_len={b.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}; "
            "raise model.max_seq_len (context_expansion does this) or lower batch.seq_len"
        )
    set_budget = [k for k in ("steps", "tokens", "tokens_per_param") if getattr(cfg.budget, k) is not None]
    if len(set_budget) != 1:
        raise GhostvisError(
            f"budget: set exactly one of steps, tokens, tokens_per_param (got {set_budget or 'none'})"
        )
    total = sum(s.weight for s in cfg.data.recipe)
    if cfg.data.recipe and (abs(total - 1.0) > 1e-6 or any(s.weight <= 0 for s in cfg.data.recipe)):
        raise GhostvisError(
            f"data.recipe weights must be positive and sum to 1, got "
            + ", ".join(f"{s.source}={s.weight}" for s in cfg.data.recipe)
        )

"""Run modes: presets for the hardware people have ("4 hours on one H100", "12 hours on an 8-GPU node").

A mode states only what the user has and wants: the model preset, the GPU, how many of them, the
wall-clock hours and the MFU it assumes. Everything else comes from the planner (budget.py) applied
to the stage's resolved config: the optimizer steps those hours buy at that MFU (`budget_for_hours`),
the tokens they train, and whether the model fits the GPU's memory (`memory_plan`). No step or token
count is typed in here.

A mode's name is accepted wherever a preset's is (`ghostvis plan --mode 1xh100-4h` or `--preset
1xh100-4h`, `ghostvis train pretrain --preset 1xh100-4h`, a stage's run config `preset`):
`presets.resolve` takes the mode's model preset and world size, and prices the config it resolves
(`priced`) in the same single pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ghostvis_core.errors import GhostvisError
from ghostvis_core.plan.budget import (
    DEFAULT_MFU,
    GPUS,
    Plan,
    StepTime,
    budget_for_hours,
    memory_plan,
    memory_refusal,
)
from ghostvis_core.plan.config import StageConfig


@dataclass(frozen=True)
class RunMode:
    """What a run mode states; the planner derives the rest. Its name says it: <gpus>x<gpu>-<hours>h."""

    preset: str  # the model preset (presets.MODELS)
    gpu: str  # a budget.GPUS name
    gpus: int  # GPUs on one node: batch.world_size
    hours: float  # wall-clock target
    mfu: float = DEFAULT_MFU  # the model FLOPs utilization the estimate assumes

    @property
    def name(self) -> str:
        return f"{self.gpus}x{self.gpu.lower()}-{self.hours:g}h"

    @property
    def step_time(self) -> StepTime:
        """The step time the mode's hours are priced at: its GPU's peak at its MFU (nothing measured)."""
        return StepTime(gpu=self.gpu, mfu=self.mfu)


_MODES = [
    *(RunMode("500m", gpu, 1, hours) for gpu in ("H100", "A100") for hours in (1, 4, 12)),
    RunMode("500m", "H100", 8, 4),  # the scale of nanochat's speedrun (d20, 8 x H100, ~4 h)
    RunMode("1.5b", "H100", 8, 12),
    RunMode("500m", "A100", 8, 12),
]
MODES: dict[str, RunMode] = {m.name: m for m in _MODES}

# What a mode decides: the user may override anything else (micro batch, seq_len, strategy, ...),
# and the planner derives the steps from the result.
MODE_KEYS = ("batch.world_size", "budget.steps", "budget.tokens", "budget.tokens_per_param")


def mode_of(name: str) -> RunMode | None:
    """The run mode called `name`; None for anything else (a preset, or a name presets.resolve refuses)."""
    return MODES.get(name)


def model_preset(name: str) -> str:
    """The model preset a preset or run mode name stands for (what a tokenizer's vocabulary follows)."""
    mode = mode_of(name)
    return mode.preset if mode else name


def mode_base(mode: RunMode, overrides: dict[str, Any]) -> dict[str, Any]:
    """The user's overrides plus the mode's world size; the keys the mode derives are refused."""
    clash = sorted(k for k in overrides if k in MODE_KEYS)
    if clash:
        raise GhostvisError(
            f"run mode {mode.name}: {', '.join(clash)} is derived from the mode ({mode.gpus} x "
            f"{mode.gpu}, {mode.hours:g} h at MFU {mode.mfu}); drop it, or use the model preset "
            f"{mode.preset} with your own values"
        )
    return {**overrides, "batch.world_size": mode.gpus}


def priced(mode: RunMode, cfg: StageConfig) -> StageConfig:
    """`cfg` with the budget.steps the mode's hours buy, once the planner has checked that it fits the mode's GPU."""
    mp = memory_plan(cfg, gpu=mode.gpu)
    if not mp.fit.fits:
        raise GhostvisError(f"run mode {mode.name}: {memory_refusal(cfg.stage, mp)}")
    return budget_for_hours(cfg, mode.hours, mode.step_time)


def describe(mode: RunMode) -> str:
    """One line: what the mode states (the planner derives the rest)."""
    peak = GPUS[mode.gpu].bf16_flops / 1e12
    return (
        f"{mode.preset} on {mode.gpus} x {mode.gpu} ({peak:,.0f} TFLOP/s bf16) for {mode.hours:g} h at MFU {mode.mfu:g}"
    )


def compute_optimal_params(p: Plan) -> float:
    """N that the plan's compute (6ND) would train to 20 tokens per parameter (Chinchilla): C = 6 N (20 N).
    Next to a mode's own N it says whether the hours suit a smaller or a larger model."""
    return (p.flops / 120) ** 0.5

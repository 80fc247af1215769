"""Run: everything one stage run holds while it trains, built by setup.py and passed to each step."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ghostvis_core.plan.batch import BatchPlan
from ghostvis_core.plan.budget import batch_plan
from ghostvis_core.plan.config import StageConfig
from ghostvis_core.data.loader import Consumption
from ghostvis_core.errors import GhostvisError
from ghostvis_core.store import Store
from ghostvis_core.run.train.dist import DistContext
from ghostvis_core.run.train.efficiency import Efficiency
from ghostvis_core.run.train.feeds import FedLog
from ghostvis_core.run.train.grpo import RolloutLog
from ghostvis_core.run.train.objectives import Objective
from ghostvis_core.run.train.parallel import SingleProcess
from ghostvis_core.run.train.spec import LaunchSpec
from ghostvis_core.run.train.state import TrainState
from ghostvis_core.run.train.tracking import Tracker


@dataclass
class Clock:
    """Wall-clock figures: time to the first optimizer step, and throughput after it."""

    launched: float = field(default_factory=time.time)
    first_step_s: float | None = None
    loop_start: float = 0.0
    last_tick: float = 0.0
    steps_timed: int = 0

    last_step_s: float = 0.0

    def tick(self, step_started: float) -> None:
        now = time.time()
        self.last_step_s = now - step_started
        self.last_tick = now
        if self.first_step_s is None:
            self.first_step_s = now - self.launched
            self.loop_start = now  # throughput excludes the first step (allocator and thread warm-up)
        else:
            self.steps_timed += 1

    def tokens_per_sec(self, tokens_per_step: int) -> float:
        """From the end of step 1 to the end of the newest step: after the loop, the last step's figure
        (what MLflow logged there), not diluted by the final evaluation and checkpoint."""
        span = self.last_tick - self.loop_start
        return self.steps_timed * tokens_per_step / max(1e-9, span) if self.steps_timed else 0.0

    def eta_s(self, steps_left: int) -> float:
        return steps_left * (time.time() - self.loop_start) / max(1, self.steps_timed)


@dataclass
class Run:
    """Everything one stage run holds while it trains."""

    spec: LaunchSpec
    cfg: StageConfig
    ctx: DistContext
    plan: BatchPlan
    total_steps: int
    store: Store
    parallel: SingleProcess  # or a Replicated / Sharded subclass
    optimizer: torch.optim.Optimizer
    objective: Objective
    bf16: bool
    tracker: Tracker
    state: TrainState
    clock: Clock
    resumed: bool
    frozen_before: str | None = None
    efficiency: Efficiency | None = None
    consumption: Consumption = field(default_factory=Consumption)
    fed: FedLog = field(default_factory=FedLog)  # what this rank fed the model since the last checkpoint
    rollouts: RolloutLog = field(default_factory=RolloutLog)  # rl: what this rank sampled since then
    step_reward: float = float("nan")  # rl: the last step's mean reward over every rank's completions
    part_first: tuple[int, int] = (0, 0)  # (step, rows) where the current ledger part began
    train_loss: float = float("nan")
    last_val: dict[str, float] = field(default_factory=dict)

    @property
    def model(self) -> torch.nn.Module:
        return self.parallel.model

    @property
    def run_dir(self) -> Path:
        """This node's folder of the run's checkpoints (written here, then published to the store)."""
        return self.store.writable("checkpoints", self.spec.stage, self.spec.run_key)

    def autocast(self):
        return torch.autocast(self.ctx.device.type, dtype=torch.bfloat16, enabled=self.bf16)


def run_batch_plan(cfg: StageConfig, ctx: DistContext) -> BatchPlan:
    """The batch plan for the ranks actually started (a world size the config did not plan is refused)."""
    if cfg.batch.total_batch_tokens is None and cfg.batch.world_size != ctx.world_size:
        raise GhostvisError(
            f"config batch.world_size={cfg.batch.world_size} but {ctx.world_size} ranks were started; "
            f"set batch.world_size={ctx.world_size} (or set batch.total_batch_tokens to derive grad_accum)"
        )
    return batch_plan(cfg.batch, ctx.world_size)

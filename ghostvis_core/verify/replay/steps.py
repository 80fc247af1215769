"""The optimizer steps of an interval, as the trainer's loop makes them (run/train/trainer.py train_step), with
the ranks' data-parallel gradient all-reduce repeated in one process.

Per step: the learning rate of the schedule (`lr_at`), each rank's micro-batches run forward and backward in
turn with the step's loss normalisation (summed loss x world / the loss units of every rank), then the
gradients combined as DDP combines them (each rank's gradient x 1/world, summed over the ranks), clipped,
and one optimizer step. With two ranks the sum a + b has one value whichever rank's buffer gloo adds into,
so the combination is bitwise DDP's; more ranks are summed in a ring order this process does not repeat
(refusal.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ghostvis_core.plan.config import StageConfig
from ghostvis_core.run.train.trainer import lr_at
from ghostvis_core.verify.replay.batches import MicroBatch


def all_reduce_like_ddp(grads: list[torch.Tensor | None]) -> torch.Tensor | None:
    """The gradient every rank holds after DDP's all-reduce of the ranks' `grads` (one rank: its own)."""
    present = [g for g in grads if g is not None]
    if len(grads) == 1 or not present:
        return grads[0]
    scaled = [g * (1.0 / len(grads)) if g is not None else torch.zeros_like(present[0]) for g in grads]
    total = scaled[0]
    for g in scaled[1:]:
        total = total + g
    return total


def rank_gradients(
    model: torch.nn.Module, params: list[torch.Tensor], batches: list[MicroBatch], scale: float, autocast: Callable
) -> list[torch.Tensor | None]:
    """One rank's accumulated gradients over its micro-batches (no sync between them, as under no_sync)."""
    for p in params:
        p.grad = None
    for b in batches:
        with autocast():
            loss_sum = model(b.inputs, b.targets, reduction="sum", **b.model_inputs())
        (loss_sum * scale).backward()
    return [p.grad for p in params]


def replay_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    ranks: list[list[MicroBatch]],
    at: tuple[int, int, StageConfig],
    autocast: Callable,
) -> None:
    """Optimizer step `step` of `total` (at = (step, total, cfg)) over every rank's micro-batches."""
    step, total, cfg = at
    lr = lr_at(step - 1, total, cfg)
    for g in optimizer.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)
    world = len(ranks)
    n_units = sum(b.units for batches in ranks for b in batches)
    params = [p for p in model.parameters() if p.requires_grad]
    per_rank = [rank_gradients(model, params, batches, world / max(1, n_units), autocast) for batches in ranks]
    for p, grads in zip(params, zip(*per_rank)):
        p.grad = all_reduce_like_ddp(list(grads))
    if cfg.optim.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

"""How the model is spread over ranks, behind one small interface the loop calls.

`Replicated` is DDP (every rank holds the model; gradients are all-reduced at the last micro-step);
a single process needs no wrapper. A sharded strategy (FSDP) plugs in here with the same methods.
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ghostvis_core.train.dist import DistContext


class SingleProcess:
    def __init__(self, model: torch.nn.Module):
        self.model = self.forward_module = model

    def accumulating(self, last_micro_step: bool):
        """No gradient sync to skip with one process."""
        return contextlib.nullcontext()


class Replicated:
    """DDP: one all-reduce per optimizer step (skipped on all micro-steps but the last)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.forward_module = DDP(model)

    def accumulating(self, last_micro_step: bool):
        return contextlib.nullcontext() if last_micro_step else self.forward_module.no_sync()


def wrap(model: torch.nn.Module, ctx: DistContext) -> SingleProcess | Replicated:
    return Replicated(model) if ctx.world_size > 1 else SingleProcess(model)

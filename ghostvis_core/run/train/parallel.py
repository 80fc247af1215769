"""How the model is spread over ranks, behind one small interface the loop calls.

- `SingleProcess`: one rank, no wrapper.
- `Replicated` (ddp): every rank holds the model; gradients are all-reduced at the last micro-step.
- `Sharded` (fsdp): FSDP2 `fully_shard` per transformer block, the vision stack and the root; each
  rank keeps 1/world of the fp32 master weights, gradients and optimizer state; blocks are
  all-gathered (in bf16 where the device computes in bf16) just before they run and freed after.

All three offer `model` (the module the optimizer and checkpoints see), `forward_module` (what a
training micro-step calls), `accumulating(last_micro_step)` (no gradient sync before the last one)
and `evaluating()` (a context in which ranks may run different numbers of forward passes, as
evaluation and sampling do).
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ghostvis_core.run.train.dist import DistContext


class SingleProcess:
    sharded = False

    def __init__(self, model: torch.nn.Module):
        self.model = self.forward_module = model

    def accumulating(self, last_micro_step: bool):
        """No gradient sync to skip with one process."""
        return contextlib.nullcontext()

    def evaluating(self):
        return contextlib.nullcontext()


class Replicated(SingleProcess):
    """DDP: one all-reduce per optimizer step (skipped on all micro-steps but the last)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.forward_module = DDP(model)

    def accumulating(self, last_micro_step: bool):
        return contextlib.nullcontext() if last_micro_step else self.forward_module.no_sync()


class Sharded(SingleProcess):
    """FSDP2. Gradients are reduce-scattered only after the last micro-step of an optimizer step."""

    sharded = True

    def __init__(self, model: torch.nn.Module, bf16: bool):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # bf16 compute copies, fp32 gradient reduction and fp32 master weights (the sharded params).
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mp_policy=mp)
        if getattr(model, "vision", None) is not None:
            fully_shard(model.vision, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        self.model = self.forward_module = model

    def accumulating(self, last_micro_step: bool):
        self.model.set_requires_gradient_sync(last_micro_step)
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def evaluating(self):
        """Gather every shard once and keep the full (compute-precision) weights until the end:
        no collective inside, so ranks may evaluate or sample different amounts."""
        from torch.distributed.fsdp import FSDPModule

        units = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        for m in units:
            m.unshard()
            m.set_reshard_after_forward(False, recurse=False)
        try:
            yield
        finally:
            for m in units:
                m.set_reshard_after_forward(True, recurse=False)
                m.reshard()


def wrap(model: torch.nn.Module, ctx: DistContext, strategy: str = "ddp", bf16: bool = False) -> SingleProcess:
    """The strategy for this launch; with one rank a model needs no wrapper whatever the strategy."""
    if ctx.world_size == 1:
        return SingleProcess(model)
    return Sharded(model, bf16) if strategy == "fsdp" else Replicated(model)

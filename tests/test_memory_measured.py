"""The memory plan against a measurement, without a GPU: for the 500m, 1.5b and 7b presets under DDP
and FSDP2, what one rank holds as parameters, gradients and AdamW state is measured on the meta
device (FSDP2 through the trainer's own `parallel.Sharded`, over a fake 8-rank process group), and
the activations autograd keeps per token and block at the planned micro batch are measured under
FakeTensorMode with bf16 autocast (one block, the saved tensors' storages; the residual stream in
fp32 under DDP, in bf16 under FSDP2, whose mixed-precision policy gathers bf16 weights). Each must be
within 15% of the plan.

The CPU computes RMSNorm as its decomposition, which keeps the normalized fp32 input of each norm
for the weight's gradient; CUDA's fused RMSNorm keeps only the input and its rstd, so those two
tensors (2 x 4d bytes per token and block) are taken off the CPU's figure."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from ghostvis_core.plan import presets
from ghostvis_core.plan.budget import GB, memory_plan
from ghostvis_core.run.model.gpt import GPT, Block
from ghostvis_core.run.train.parallel import Sharded

PLAN_TOLERANCE = 0.15
WORLD = 8


@pytest.fixture(scope="module")
def fake_group():
    """A process group of WORLD ranks in which this process is rank 0 and no collective moves data."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    yield
    dist.destroy_process_group()


def nbytes(t: torch.Tensor) -> int:
    """This rank's bytes of a tensor (the local shard of an FSDP2 DTensor)."""
    return (t.to_local() if hasattr(t, "to_local") else t).untyped_storage().nbytes()


def measured_states(cfg) -> dict[str, float]:
    """GB of parameters, gradients and AdamW state on rank 0, the model built on the meta device and
    wrapped as the trainer wraps it (FSDP2 shards over the fake group; DDP keeps a full copy)."""
    with torch.device("meta"):
        model = GPT(cfg.model)
    if cfg.parallel.strategy == "fsdp":
        Sharded(model, bf16=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # creates the moments (and step counters) as the first real step does
    return {
        "weights_gb": sum(nbytes(p) for p in model.parameters()) / GB,
        "grads_gb": sum(nbytes(p.grad) for p in model.parameters()) / GB,
        "optimizer_gb": sum(nbytes(v) for s in opt.state.values() for v in s.values()) / GB,
    }


def residual_bytes(cfg) -> int:
    """The residual stream's element size: FSDP2 computes with bf16 weights, so the embedding's output
    and every block's are bf16; under DDP autocast the weights, and so the residual, stay fp32."""
    return 2 if cfg.parallel.strategy == "fsdp" else 4


def measured_block_bytes_per_token(cfg) -> float:
    """Bytes autograd keeps per token for one block under bf16 autocast at the planned micro batch
    (distinct storages of the saved tensors, the block's weights excluded), less the CPU-only copies
    of RMSNorm's normalized input (see the module docstring)."""
    m, b = cfg.model, cfg.batch
    with FakeTensorMode():
        torch.set_default_dtype(torch.bfloat16)  # bf16 weights: autocast makes no weight copies to count
        try:
            block = Block(m)
        finally:
            torch.set_default_dtype(torch.float32)
        weights = {p.untyped_storage()._cdata for p in block.parameters()}
        saved: dict[int, int] = {}

        def pack(t):
            storage = t.untyped_storage()
            if storage._cdata not in weights:
                saved.setdefault(storage._cdata, storage.nbytes())
            return t

        dtype = torch.bfloat16 if residual_bytes(cfg) == 2 else torch.float32
        x = torch.empty(b.micro_batch_size, b.seq_len, m.d_model, dtype=dtype, requires_grad=True)
        cos = sin = torch.empty(b.seq_len, m.head_dim // 2)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
            block(x, cos, sin)
    return sum(saved.values()) / (b.micro_batch_size * b.seq_len) - 2 * 4 * m.d_model


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("preset", ["500m", "1.5b", "7b"])
def test_the_plans_weights_grads_and_optimizer_state_are_what_one_rank_holds(fake_group, preset, strategy):
    cfg = presets.resolve("pretrain", preset, {"parallel.strategy": strategy, "batch.world_size": WORLD})
    plan = memory_plan(cfg)
    measured = measured_states(cfg)
    for part, value in measured.items():
        assert getattr(plan, part) == pytest.approx(value, rel=PLAN_TOLERANCE), part
    # the shapes make these exact: fp32 weights and grads, two fp32 moments (FSDP2: an eighth, 7b's
    # shards padded to whole rows)
    assert plan.weights_gb == pytest.approx(measured["weights_gb"], abs=1e-3)
    assert plan.optimizer_gb == pytest.approx(measured["optimizer_gb"], abs=2e-3)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("preset", ["500m", "1.5b", "7b"])
def test_the_plans_activations_are_what_autograd_keeps_at_the_planned_micro_batch(preset, strategy):
    cfg = presets.resolve("pretrain", preset, {"parallel.strategy": strategy})
    m, b = cfg.model, cfg.batch
    plan = memory_plan(cfg)
    tokens = b.micro_batch_size * b.seq_len
    per_block = measured_block_bytes_per_token(cfg) * tokens
    if cfg.runtime.grad_checkpointing:  # each block's input kept (the residual), one block recomputed
        measured = m.n_layers * m.d_model * tokens * residual_bytes(cfg) + per_block
    else:
        measured = m.n_layers * per_block
    print(f"{preset} {strategy}: activations planned {plan.activations_gb:.2f} GB, measured {measured / GB:.2f} GB")
    assert plan.activations_gb == pytest.approx(measured / GB, rel=PLAN_TOLERANCE)

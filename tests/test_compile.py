"""torch.compile of the model step on CPU (inductor, as `runtime.compile=on` compiles each block):
the same loss and gradients as eager. The GPU compiles the same blocks with Triton kernels instead
of C++ ones; benchmarks/gpu_check.py times them there."""

from __future__ import annotations

import torch

from ghostvis_core.plan.config import ModelConfig
from ghostvis_core.run.model.gpt import GPT

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=32)


def loss_and_grads(model: GPT, x: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(x[:, :-1], x[:, 1:])
    loss.backward()
    return float(loss), [p.grad.clone() for p in model.parameters()]


def test_compiled_blocks_give_the_eager_loss_and_gradients():
    torch.manual_seed(0)
    model = GPT(CFG)
    x = torch.randint(0, CFG.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    eager_loss, eager_grads = loss_and_grads(model, x)
    model.compile_blocks()  # what the trainer calls (use_compile), on this CPU through inductor
    compiled_loss, compiled_grads = loss_and_grads(model, x)
    assert all(hasattr(b, "_compiled_call_impl") and b._compiled_call_impl is not None for b in model.blocks)
    assert abs(compiled_loss - eager_loss) <= 1e-5 * abs(eager_loss)
    for name, e, c in zip([n for n, _ in model.named_parameters()], eager_grads, compiled_grads):
        torch.testing.assert_close(c, e, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")

"""float8 training (runtime.float8) on CPU: which of the real GPT's layers torchao converts, the config
key, the checkpoint round trip between converted and unconverted models, and the trainer's refusal on
hardware without float8 tensor cores, and the trainer's float8 matmuls running on CPU. (The speed is measured on a GPU
by benchmarks/gpu_throughput.py and benchmarks/gpu_check.py.)"""

from __future__ import annotations

import pytest
import torch
from torchao.float8.float8_linear import Float8Linear  # torchao is in the dev extra as well as the gpu one

from ghostvis_core.errors import GhostvisError
from ghostvis_core.plan.config import ModelConfig, StageConfig, VisionConfig, apply_overrides
from ghostvis_core.plan.presets import resolve
from ghostvis_core.run.model.gpt import GPT
from ghostvis_core.run.train import checkpoint as ckpt
from ghostvis_core.run.train import float8
from ghostvis_core.run.train.dist import DistContext
from ghostvis_core.run.train.setup import build_model
from ghostvis_core.store.layout import step_dir_name

# head_dim 16; ffn_hidden 72: w13 is 64 -> 144 (both divide by 16), w2 is 72 -> 64 (72 does not);
# vocab 96 divides by 16 too, but the head is skipped by name
CFG = ModelConfig(vocab_size=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=72, max_seq_len=32)
CONVERTED = [f"blocks.{i}.{name}" for i in range(2) for name in ("attn.wq", "attn.wkv", "attn.wo", "ffn.w13")]


def gpt(seed: int = 0, vision: bool = False) -> GPT:
    torch.manual_seed(seed)
    model = GPT(CFG)
    if vision:
        model.attach_vision(
            VisionConfig(
                image_size=32, patch_size=4, d_vision=32, n_layers=1, n_heads=4, n_latents=4, resampler_layers=1
            )
        )
    return model


def test_the_decoder_linears_with_dims_divisible_by_16_convert_and_nothing_else():
    model = gpt(vision=True)
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert "lm_head" in linears and "blocks.0.ffn.w2" in linears and any(n.startswith("vision.") for n in linears)
    assert float8.float8_layers(model) == CONVERTED
    assert float8.convert(model) == CONVERTED
    swapped = sorted(n for n, m in model.named_modules() if isinstance(m, Float8Linear))
    assert swapped == sorted(CONVERTED)
    assert type(model.lm_head) is torch.nn.Linear and type(model.blocks[1].ffn.w2) is torch.nn.Linear


def test_the_config_key_round_trips():
    assert resolve("pretrain", "tiny").runtime.float8 is False
    cfg = resolve("pretrain", "tiny", {"runtime.float8": "true"})
    assert cfg.runtime.float8 is True
    back = StageConfig.from_dict(cfg.to_dict())
    assert back == cfg and back.runtime.float8 is True
    assert apply_overrides(cfg.to_dict(), {"runtime.float8": "false"})["runtime"]["float8"] is False


def test_a_converted_checkpoint_loads_into_an_unconverted_model_and_back(tmp_path):
    converted = gpt(seed=1)
    float8.convert(converted)
    opt = torch.optim.AdamW(converted.parameters(), lr=1e-3)
    path = ckpt.save(tmp_path / "run", 5, model=converted, optimizer=opt, state={"step": 5}, config={})
    plain = gpt(seed=2)  # other weights, so equality below means they were loaded
    ckpt.load_model(path, plain)
    want, got = converted.state_dict(), plain.state_dict()
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    # and back: an unconverted checkpoint (the upstream stage trained in bf16) into a converted model
    path = ckpt.save(tmp_path / "plain", 1, model=gpt(seed=3), optimizer=None, state={}, config={})
    again = gpt(seed=4)
    float8.convert(again)
    ckpt.load_model(path, again)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), gpt(seed=3).state_dict().values()))
    ckpt.load_optimizer(tmp_path / "run" / step_dir_name(5), again, torch.optim.AdamW(again.parameters()))


def test_float8_is_refused_without_an_sm89_gpu_naming_the_fix():
    with pytest.raises(GhostvisError, match=r"compute capability >= 8\.9.*trains on cpu.*runtime\.float8=false"):
        float8.require_float8(torch.device("cpu"))
    cfg = resolve("pretrain", "tiny", {"runtime.float8": "true"})
    with pytest.raises(GhostvisError, match=r"runtime\.float8=false"):  # the trainer's own model build
        build_model(cfg, DistContext(0, 0, 1, torch.device("cpu")))


def test_the_converted_gpt_trains_in_emulated_float8_on_cpu():
    """torchao's emulation (float8 rounding without float8 kernels) through the real GPT: the loss stays
    within float8's error of the unconverted model's and gradients reach the converted weights."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    plain, converted = gpt(seed=5), gpt(seed=5)
    convert_to_float8_training(
        converted, config=Float8LinearConfig(emulate=True), module_filter_fn=float8.float8_filter
    )
    x = torch.randint(0, CFG.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    want, got = plain(x[:, :-1], x[:, 1:]), converted(x[:, :-1], x[:, 1:])
    w, g = float(want.detach()), float(got.detach())
    assert g == pytest.approx(w, rel=1e-2) and g != w
    got.backward()
    assert all(converted.get_submodule(n).weight.grad.abs().sum() > 0 for n in CONVERTED)


def test_the_trainers_own_conversion_runs_float8_matmuls_on_cpu():
    """`float8.convert` (the tensorwise recipe the trainer uses, not emulation) through the GPT under bf16
    autocast: PyTorch 2.13's CPU runs its float8 scaled matmuls, so forward and backward run here; the
    loss is within float8's error of the unconverted model's. Speed needs float8 tensor cores:
    benchmarks/gpu_check.py measures it and says why where it cannot."""
    plain, converted = gpt(seed=5), gpt(seed=5)
    assert float8.convert(converted) == CONVERTED
    x = torch.randint(0, CFG.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = plain(x[:, :-1], x[:, 1:]), converted(x[:, :-1], x[:, 1:])
    w, g = float(want.detach()), float(got.detach())
    assert g == pytest.approx(w, rel=1e-2) and g != w
    got.backward()
    assert all(converted.get_submodule(n).weight.grad.abs().sum() > 0 for n in CONVERTED)

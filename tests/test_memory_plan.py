"""The memory plan: per-GPU memory by hand for two presets, the fixes it names, and `ghostvis plan`
as a new user would call it."""

from __future__ import annotations

import argparse
import json

import pytest

from ghostvis_core.errors import GhostvisError
from ghostvis_core.plan import presets
from ghostvis_core.plan.budget import GB, GPUS, GpuFit, flops_per_token, gpu_of, memory_plan, plan
from ghostvis_pipeline.cli import build_parser
from ghostvis_pipeline.cli import main as cli_main


def test_500m_ddp_on_an_h100_by_hand():
    m = memory_plan(presets.resolve("pretrain", "500m"), gpu="H100")
    # N: per layer attn 3 x 1280^2 = 4,915,200; ffn 3 x 1280 x 3456 = 13,271,040; norms 2,560 -> 18,188,800
    # x 24 + 1,280 = 436,532,480; + 2 tables 65,536 x 1,280 = 604,304,640
    n = 604_304_640
    assert (m.strategy, m.bf16, m.grad_checkpointing, m.world_size) == ("ddp", True, False, 8)
    assert m.weights_gb == m.grads_gb == round(4 * n / GB, 3)  # fp32, whole model on every GPU
    assert m.optimizer_gb == round(8 * n / GB, 3)  # AdamW's two fp32 moments
    assert m.buffers_gb == round(6 * n / GB, 3)  # fp32 gradient buckets + bf16 autocast weight copies
    # activations: (7 x 1280 + 2 x 640 + 4 x 3456) = 24,064 elements per token and block, bf16,
    # micro batch 8 x 2048 = 16,384 tokens, 24 blocks
    assert m.activations_gb == round(24_064 * 16_384 * 2 * 24 / GB, 3) == 18.925
    # logits: 2^26 // 65,536 = 1,024 positions at a time x 65,536 x (2 bf16 + 4 fp32 + 4 grad) bytes
    assert m.logits_gb == round(1_024 * 65_536 * 10 / GB, 3) == 0.671
    total = (4 + 4 + 8 + 6) * n + 24_064 * 16_384 * 2 * 24 + 1_024 * 65_536 * 10
    assert m.total_gb == round(total / GB, 3) == pytest.approx(32.89, abs=1e-3)
    assert m.fit.fits and m.fit.usable_gb == 72.0 and m.fit.fixes == []


def test_7b_fsdp_with_activation_checkpointing_by_hand():
    m = memory_plan(presets.resolve("pretrain", "7b"), gpu="H100")
    n, block = 7_516_459_008, 218_112_000  # the hand counts of test_budget.test_7b_plan_chinchilla_default
    root = n - 32 * block  # the two 65,536 x 4,096 tables and the final norm: 536,875,008
    assert (m.strategy, m.grad_checkpointing, m.world_size) == ("fsdp", True, 8)
    assert m.weights_gb == m.grads_gb == round(4 * n / 8 / GB, 3) == 3.758  # sharded over 8 GPUs
    assert m.optimizer_gb == round(8 * n / 8 / GB, 3)
    # two gathered blocks (bf16) + the root (bf16) + one block's fp32 gradient before reduce-scatter
    assert m.buffers_gb == round(((2 * block + root) * 2 + 4 * block) / GB, 3) == 2.819
    # checkpointed: 32 block inputs of 4,096 bf16 per token + one block recomputed
    # (7 x 4096 + 2 x 1024 + 4 x 14336 = 88,064 elements per token), 16,384 tokens
    acts = 32 * 4_096 * 16_384 * 2 + 88_064 * 16_384 * 2
    assert m.activations_gb == round(acts / GB, 3) == 7.181
    assert m.total_gb == round((16 * n / 8 + (2 * block + root) * 2 + 4 * block + acts + 671_088_640) / GB, 3)
    assert m.fit.fits


def test_7b_under_ddp_does_not_fit_and_fsdp_is_named_with_its_total():
    m = memory_plan(presets.resolve("pretrain", "7b", {"parallel.strategy": "ddp"}), gpu="H100")
    assert not m.fit.fits and m.total_gb > 150
    assert m.fit.fixes == [
        f"parallel.strategy=fsdp: {memory_plan(presets.resolve('pretrain', '7b'), gpu='H100').total_gb:.1f} GB"
    ]


def test_without_activation_checkpointing_7b_names_each_fix_that_fits_alone():
    cfg = presets.resolve("pretrain", "7b", {"runtime.grad_checkpointing": False})
    m = memory_plan(cfg, gpu="H100")
    assert not m.fit.fits and m.total_gb == pytest.approx(110.86, abs=0.01)
    # micro batch 4: 32 blocks x 88,064 elements x 8,192 tokens x 2 bytes = 46.2 GB of activations
    assert m.fit.fixes == [
        "runtime.grad_checkpointing=true: 25.7 GB",
        "batch.micro_batch_size=4 with batch.grad_accum_steps=8 (same tokens_per_step): 64.7 GB",
    ]
    assert memory_plan(cfg, gpu="A100-40GB").fit.fixes == ["runtime.grad_checkpointing=true: 25.7 GB"]


def test_on_a_24gb_gpu_7b_needs_more_gpus():
    m = memory_plan(presets.resolve("pretrain", "7b"), gpu="RTX4090")
    assert not m.fit.fits
    assert m.fit.fixes == ["shard over 16 GPUs (batch.world_size=16, grad_accum halved): 18.2 GB"]


def test_the_preflight_refuses_a_detected_gpu_the_table_does_not_know_by_its_memory(monkeypatch):
    """On a CUDA machine the pre-flight checks the detected device: an unknown name (None) still has its
    memory, and the refusal names 'the GPU' with it. The memory check comes before the data check."""
    from ghostvis_core.run import preflight as preflight_module

    cfg = presets.resolve("pretrain", "7b")
    monkeypatch.setattr(preflight_module, "detected_gpu", lambda: (None, 24.0))
    with pytest.raises(GhostvisError) as exc:
        preflight_module.preflight(cfg, plan(cfg), objective=None)
    assert memory_plan(cfg, gpu_memory_gb=24.0).fit == GpuFit(
        None, 24.0, 21.6, False, ["shard over 16 GPUs (batch.world_size=16, grad_accum halved): 18.2 GB"]
    )
    assert "does not fit the GPU (21.6 of 24 GB usable) on 8 GPUs; fix: shard over 16 GPUs" in str(exc.value)


def test_flops_per_token_counts_attention():
    cfg = presets.resolve("pretrain", "tiny").model
    # 6 N + 12 x layers x d x seq_len: 6 x 3,950,848 + 12 x 4 x 256 x 256
    assert flops_per_token(cfg, 256) == 6 * 3_950_848 + 12 * 4 * 256 * 256


def test_detected_device_names_map_to_the_table():
    assert gpu_of("NVIDIA H100 80GB HBM3") == "H100"
    assert gpu_of("NVIDIA A100-SXM4-80GB") == "A100"
    assert gpu_of("NVIDIA GeForce RTX 4090") == "RTX4090"
    assert gpu_of("NVIDIA L40S") == "L40S"
    assert gpu_of("Tesla V100-SXM2-16GB") is None


def _plan_cli(capsys, *argv):
    rc = cli_main(["plan", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_7b_on_h100_is_fsdp_and_fits_on_8_gpus(capsys):
    rc, out, _ = _plan_cli(capsys, "--preset", "7b", "--gpu", "H100", "--json")
    m = json.loads(out)["memory"]
    assert rc == 0
    assert (m["strategy"], m["world_size"], m["fit"]["gpu"], m["fit"]["fits"]) == ("fsdp", 8, "H100", True)
    assert m["total_gb"] == memory_plan(presets.resolve("pretrain", "7b"), gpu="H100").total_gb


@pytest.mark.parametrize("flag", [["--set", "parallel.strategy=ddp"], ["--strategy", "ddp"]])
def test_cli_7b_under_ddp_is_refused_with_the_numbers_and_the_fix(capsys, flag):
    rc, out, err = _plan_cli(capsys, "--preset", "7b", "--gpu", "H100", "--json", *flag)
    assert rc == 2
    assert json.loads(out)["memory"]["fit"]["fits"] is False  # --json carries the same
    assert err.startswith(
        "ghostvis: error: stage pretrain: 177.5 GB per GPU (30.1 weights + 30.1 grads + 60.1 optimizer"
    )
    assert "does not fit H100 (72.0 of 80 GB usable) on 8 GPUs; fix: parallel.strategy=fsdp: 25.7 GB" in err


@pytest.mark.parametrize("extra", [[], ["--params", "1000000000"]])
def test_a_new_users_plan_with_a_longer_context_is_planned_with_a_note(capsys, extra):
    rc, out, err = _plan_cli(
        capsys,
        "--micro-batch-size",
        "16",
        "--seq-len",
        "4096",
        "--world-size",
        "8",
        "--grad-accum",
        "4",
        "--steps",
        "1000",
        *extra,
    )
    assert rc == 0, err
    assert "= 16 x 4096 x 8 x 4 = 2,097,152" in out
    assert "note: seq_len 4096 is beyond the tiny model's context (256)" in out
    assert "memory per GPU" in out


def test_every_plan_flag_is_explained_in_help():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    plan = sub.choices["plan"]
    unexplained = [a.option_strings for a in plan._actions if not a.help and a.option_strings != ["-h", "--help"]]
    assert unexplained == []


def test_the_gpu_table_has_memory_and_peak_for_each():
    assert {"A100", "A100-40GB", "H100", "H200", "L40S", "RTX4090"} <= set(GPUS)
    assert all(g.memory_gb > 0 and g.bf16_flops > 0 for g in GPUS.values())


def test_a_run_mode_in_hours_gets_its_steps_from_the_planner(capsys):
    rc, out, _ = _plan_cli(
        capsys, "--preset", "500m", "--world-size", "1", "--gpu", "H100", "--mfu", "0.4", "--hours", "4", "--json"
    )
    got = json.loads(out)
    # (6 x N 520,418,560 + attention 12 x 24 layers x 1280 x 2048) x 524,288 tokens per step / (989e12 x 0.4)
    # = 5.139 s per step; 14,400 s / 5.139 = 2,802.2
    step = (6 * 520_418_560 + 12 * 24 * 1280 * 2048) * 524_288 / (989e12 * 0.4)
    assert rc == 0 and got["steps"] == int(4 * 3600 // step) == 2_802
    assert got["planned_tokens"] == 2_802 * 524_288 and got["gpu_hours"] == pytest.approx(2_802 * step / 3600)
    assert got["memory"]["buffers_gb"] == round(2 * 604_304_640 / GB, 3)  # one process: no DDP buckets


def test_hours_without_a_step_time_or_gpu_says_what_to_give(capsys):
    rc, _, err = _plan_cli(capsys, "--preset", "500m", "--hours", "4")
    assert rc == 2 and "give --step-time (measured) or --gpu (with --mfu)" in err

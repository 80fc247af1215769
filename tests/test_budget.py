"""The planner: tokens_per_step, grad_accum derivation, steps, 6ND FLOPs, GPU-hours and cost.

Every expected number below is worked out by hand in the comment next to it, not re-derived
through the code under test.
"""

from __future__ import annotations

import json
import re

import pytest

from ghostvis_core.errors import GhostvisError
from ghostvis_core.plan import presets
from ghostvis_core.plan.budget import (
    GPU_PEAK_FLOPS,
    LM_NEEDED_RULE,
    BatchPlan,
    StepTime,
    batch_plan,
    budget_for_hours,
    lm_tokens_for_rows,
    plan,
    source_plan,
)
from ghostvis_core.plan.config import BatchConfig, BudgetConfig, ModelConfig
from ghostvis_core.plan.model_shape import count_params
from ghostvis_core.run.model.gpt import GPT
from ghostvis_pipeline.cli import main as cli_main

# tiny preset model: vocab 4096, d 256, 4 layers, 4 heads (head_dim 64), 2 kv heads, ffn 688.
#   attention per layer = wq 256*256 + wkv 256*(2*2*64) + wo 256*256 = 65,536 * 3       = 196,608
#   ffn per layer       = w13 256*(2*688) + w2 688*256 = 3*256*688                     = 528,384
#   norms per layer     = 2*256                                                        =     512
#   4 layers + final norm = 4*725,504 + 256                                            = 2,902,272
#   embedding table = lm_head = 4096*256                                               = 1,048,576
TINY_LAYERS = 2_902_272
TINY_TABLE = 1_048_576
TINY_N = TINY_LAYERS + TINY_TABLE  # non-embedding: everything but the input table = 3,950,848
TINY_TOTAL = TINY_LAYERS + 2 * TINY_TABLE  # 4,999,424


# ---------------------------------------------------------------- tokens_per_step


def test_tokens_per_step_uses_all_four_factors():
    bp = BatchPlan(micro_batch_size=4, seq_len=1024, world_size=8, grad_accum_steps=16)
    assert bp.tokens_per_step == 524_288  # 4 * 1024 = 4096; * 8 = 32768; * 16 = 524288
    assert bp.rows_per_step == 512  # 4 * 8 * 16
    # The classic errors give other numbers:
    assert BatchPlan(4, 1024, 8, 1).tokens_per_step == 32_768  # forgot grad_accum: 16x too few
    assert BatchPlan(4, 1024, 1, 16).tokens_per_step == 65_536  # forgot world_size: 8x too few
    assert BatchPlan(1, 1024, 8, 16).tokens_per_step == 131_072  # forgot micro batch
    assert len({524_288, 32_768, 65_536, 131_072}) == 4


def test_batch_plan_from_explicit_grad_accum():
    bp = batch_plan(BatchConfig(micro_batch_size=4, seq_len=1024, world_size=8, grad_accum_steps=16))
    assert (bp.micro_batch_size, bp.seq_len, bp.world_size, bp.grad_accum_steps) == (4, 1024, 8, 16)
    assert bp.tokens_per_step == 524_288
    # the launcher's world size wins over the config's; grad_accum stays, so the step shrinks
    bp4 = batch_plan(BatchConfig(4, 1024, world_size=8, grad_accum_steps=16), world_size=4)
    assert bp4.world_size == 4 and bp4.tokens_per_step == 262_144  # 4*1024*4*16


def test_batch_plan_default_grad_accum_is_one():
    bp = batch_plan(BatchConfig(micro_batch_size=2, seq_len=64, world_size=3))
    assert bp.grad_accum_steps == 1 and bp.tokens_per_step == 384  # 2*64*3*1


def test_total_batch_tokens_derives_grad_accum():
    # 524288 / (8 * 2048 * 8 = 131072) = 4
    bp = batch_plan(BatchConfig(micro_batch_size=8, seq_len=2048, world_size=8, total_batch_tokens=524_288))
    assert bp.grad_accum_steps == 4
    assert bp.tokens_per_step == 524_288
    # Half the GPUs: grad_accum doubles and the step keeps its size.
    bp4 = batch_plan(BatchConfig(8, 2048, world_size=8, total_batch_tokens=524_288), world_size=4)
    assert (bp4.world_size, bp4.grad_accum_steps, bp4.tokens_per_step) == (4, 8, 524_288)


def test_total_batch_tokens_not_divisible_names_the_divisor():
    with pytest.raises(GhostvisError) as exc:
        batch_plan(BatchConfig(micro_batch_size=8, seq_len=2048, world_size=8, total_batch_tokens=500_000))
    msg = str(exc.value)
    assert "500000" in msg
    assert "131072" in msg  # 8 x 2048 x 8
    assert "8 x 2048 x 8" in msg


def test_grad_accum_contradicting_total_batch_tokens():
    with pytest.raises(GhostvisError) as exc:
        batch_plan(BatchConfig(8, 2048, world_size=8, grad_accum_steps=2, total_batch_tokens=524_288))
    msg = str(exc.value)
    assert "grad_accum_steps=2" in msg and "grad_accum_steps=4" in msg and "524288" in msg
    # the consistent pair is accepted
    assert (
        batch_plan(BatchConfig(8, 2048, world_size=8, grad_accum_steps=4, total_batch_tokens=524_288)).grad_accum_steps
        == 4
    )


@pytest.mark.parametrize("accum", [0, -2])
def test_non_positive_grad_accum_is_refused(accum):
    with pytest.raises(GhostvisError, match="grad_accum_steps must be positive"):
        batch_plan(BatchConfig(8, 256, world_size=1, grad_accum_steps=accum))


# ---------------------------------------------------------------- steps and budgets


def _tiny(**overrides):
    """tiny pretrain (8 x 256 x 2 x 1 = 4096 tokens/step) with its `steps` budget cleared if asked."""
    return presets.resolve("pretrain", "tiny", overrides)


def test_steps_budget():
    p = plan(_tiny())  # preset: 200 steps
    assert p.batch.tokens_per_step == 4096  # 8 * 256 * 2 * 1
    assert p.steps == 200
    assert p.planned_tokens == p.step_tokens_total == 819_200  # 200 * 4096


def test_steps_from_tokens_round_up():
    p = plan(_tiny(**{"budget.steps": None, "budget.tokens": 1_000_000}))
    # 1,000,000 / 4096 = 244.14 -> 245 steps (ceil: never train fewer tokens than asked)
    assert p.steps == 245
    assert p.planned_tokens == 1_000_000
    assert p.step_tokens_total == 1_003_520  # 245 * 4096
    assert 0 <= p.step_tokens_total - p.planned_tokens < p.batch.tokens_per_step  # 3,520 < 4,096


def test_steps_from_tokens_exact_multiple():
    p = plan(_tiny(**{"budget.steps": None, "budget.tokens": 40_960}))
    assert p.steps == 10 and p.step_tokens_total == 40_960


def test_tokens_below_one_step_still_gives_one_step():
    p = plan(_tiny(**{"budget.steps": None, "budget.tokens": 1}))
    assert p.steps == 1 and p.step_tokens_total == 4096


def test_tokens_per_param_budget():
    p = plan(_tiny(**{"budget.steps": None, "budget.tokens_per_param": 20.0}))
    assert p.params_non_embedding == TINY_N == 3_950_848
    assert p.planned_tokens == 79_016_960  # 20 * 3,950,848
    # 79,016,960 / 4096 = 19,291.25 -> 19,292 steps
    assert p.steps == 19_292
    assert p.step_tokens_total == 79_020_032  # 19,292 * 4096
    assert p.step_tokens_total - p.planned_tokens == 3_072
    assert p.tokens_per_param == pytest.approx(79_020_032 / 3_950_848, rel=1e-15)


def test_flops_are_6ND_exactly():
    p = plan(_tiny())
    # 6 * 3,950,848 * 819,200 = 19,419,208,089,600 (exact in float64: < 2**53)
    assert p.flops == 19_419_208_089_600.0
    assert p.params_total == TINY_TOTAL


def test_gpu_hours_and_cost_from_step_time():
    cfg = _tiny(**{"budget.steps": 7200})
    p = plan(cfg, step_time=StepTime(seconds=1.5), price_per_gpu_hour=2.5)
    # 7200 steps * 1.5 s = 10,800 s = 3 h wall; x 2 GPUs = 6 GPU-hours; x 2.5 = 15.0
    assert p.step_time_s == 1.5
    assert p.gpu_hours == pytest.approx(6.0, rel=1e-12)
    assert p.cost == pytest.approx(15.0, rel=1e-12)
    # no price -> no cost, no time -> neither
    assert plan(cfg, step_time=StepTime(seconds=1.5)).cost is None
    none = plan(cfg)
    assert none.gpu_hours is None and none.cost is None and none.step_time_s is None


def _seven_b_million_token_steps():
    """7b preset with 125 x 1000 x 8 GPUs and total_batch_tokens 1,000,000 -> grad_accum 1."""
    return presets.resolve(
        "pretrain",
        "7b",
        {
            "batch.micro_batch_size": 125,
            "batch.seq_len": 1000,
            "batch.total_batch_tokens": 1_000_000,
        },
    )


def test_step_time_from_gpu_peak_and_mfu():
    cfg = _seven_b_million_token_steps()
    n = 208_000_000
    p = plan(cfg, params=n, step_time=StepTime(gpu="A100", mfu=0.5), price_per_gpu_hour=2.25)
    assert (p.batch.grad_accum_steps, p.batch.tokens_per_step) == (1, 1_000_000)
    # model FLOPs per token: 6 x 208e6 + attention 12 x 32 layers x 4096 x 1000 positions = 2.820864e9;
    # per step x 1e6 tokens = 2.820864e15; cluster rate 8 x 312e12 x 0.5 = 1.248e15 /s -> 2.2603 s
    assert p.flops_per_token == 2_820_864_000
    step = 2.820864e15 / 1.248e15
    assert p.step_time_s == pytest.approx(step, rel=1e-12)
    # 20 tokens/param: 4.16e9 tokens = 4160 steps exactly
    assert p.planned_tokens == 4_160_000_000 and p.steps == 4160 and p.step_tokens_total == 4_160_000_000
    assert p.tokens_per_param == 20.0
    # 4160 steps x 2.2603 s = 9,402.5 s of wall clock (2.61 h) on 8 GPUs = 20.89 GPU-hours; x 2.25 = 47.01
    assert p.hours == pytest.approx(4160 * step / 3600, rel=1e-12)
    assert p.gpu_hours == pytest.approx(4160 * step * 8 / 3600, rel=1e-12)
    assert p.cost == pytest.approx(4160 * step * 8 / 3600 * 2.25, rel=1e-12)
    assert p.flops == pytest.approx(5.19168e18, rel=1e-12)  # 6 * 2.08e8 * 4.16e9
    assert p.params_non_embedding == p.params_total == n


def test_lower_mfu_means_proportionally_longer_steps():
    cfg = _seven_b_million_token_steps()
    fast = plan(cfg, params=208_000_000, step_time=StepTime(gpu="A100", mfu=0.5))
    slow = plan(cfg, params=208_000_000, step_time=StepTime(gpu="A100", mfu=0.25))
    assert slow.step_time_s == pytest.approx(2 * fast.step_time_s, rel=1e-12)
    assert slow.gpu_hours == pytest.approx(2 * fast.gpu_hours, rel=1e-12)


def test_unknown_gpu_lists_known_ones():
    with pytest.raises(GhostvisError) as exc:
        plan(_tiny(), step_time=StepTime(gpu="V100"))
    assert "V100" in str(exc.value)
    for name in GPU_PEAK_FLOPS:
        assert name in str(exc.value)


def test_a_measured_step_time_wins_over_the_gpu_estimate():
    """StepTime(seconds, gpu): the measured seconds price the plan; the GPU is still the memory plan's."""
    p = plan(_tiny(), step_time=StepTime(seconds=1.5, gpu="L4", mfu=0.1))
    assert p.step_time_s == 1.5 and p.hours == 200 * 1.5 / 3600
    fit = p.memory["fit"]
    assert (fit["gpu"], fit["memory_gb"], fit["fits"]) == ("L4", 24, True)


def test_budget_for_hours_buys_the_steps_that_fit():
    # 1 h at a measured 1.5 s per step: floor(3600 / 1.5) = 2400 steps
    assert budget_for_hours(_tiny(), 1, StepTime(seconds=1.5)).budget == BudgetConfig(steps=2400)
    with pytest.raises(GhostvisError, match="a budget in hours needs a step time: give --step-time"):
        budget_for_hours(_tiny(), 1, StepTime())


def test_7b_plan_chinchilla_default():
    p = plan(presets.resolve("pretrain", "7b"))
    # batch: 8 x 2048 x 8 with total 524,288 -> grad_accum 4
    assert p.batch == BatchPlan(8, 2048, 8, 4)
    # 7b N (hand count): per layer attn 4096*4096*2 + 4096*2*8*128 = 41,943,040; ffn 3*4096*14336
    # = 176,160,768; norms 8,192 -> 218,112,000 x 32 + 4096 = 6,979,588,096; + lm_head 268,435,456
    assert p.params_non_embedding == 7_248_023_552
    assert p.params_total == 7_516_459_008  # + input table 65536*4096
    assert p.planned_tokens == 144_960_471_040  # 20 * N
    assert p.steps == 276_491  # ceil(144,960,471,040 / 524,288) = ceil(276,490.16)
    assert p.step_tokens_total == 276_491 * 524_288 == 144_960_913_408
    assert p.step_tokens_total - p.planned_tokens < p.batch.tokens_per_step


# ---------------------------------------------------------------- count_params vs the real model


def test_count_params_tiny_matches_built_model():
    cfg = presets.resolve("pretrain", "tiny").model
    counts = count_params(cfg)
    model = GPT(cfg)
    built_total = sum(p.numel() for p in model.parameters())
    assert counts["total"] == built_total == TINY_TOTAL
    assert counts["non_embedding"] == built_total - model.embed.weight.numel() == TINY_N
    assert counts["embedding"] == model.embed.weight.numel() == TINY_TABLE


def test_count_params_tied_embeddings_matches_built_model():
    cfg = ModelConfig(
        vocab_size=96,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=1,
        ffn_hidden=40,
        max_seq_len=16,
        tie_embeddings=True,
    )
    model = GPT(cfg)
    built = sum(p.numel() for p in model.parameters())  # parameters() yields the shared table once
    # per layer: wq 32*32 + wkv 32*2*1*8 + wo 32*32 = 2560; ffn 3*32*40 = 3840; norms 64 -> 6464
    # 2 layers + final norm = 12,960; table 96*32 = 3072 (one copy, shared with lm_head)
    assert built == 16_032
    assert count_params(cfg) == {"total": 16_032, "non_embedding": 16_032, "embedding": 3072}


# ---------------------------------------------------------------- bad input


def test_unknown_preset():
    with pytest.raises(GhostvisError) as exc:
        presets.resolve("pretrain", "huge")
    assert "unknown preset 'huge'" in str(exc.value)
    assert "tiny" in str(exc.value) and "7b" in str(exc.value)


def test_unknown_stage():
    with pytest.raises(GhostvisError) as exc:
        presets.resolve("pretraining", "tiny")
    assert "unknown stage 'pretraining'" in str(exc.value)
    assert "pretrain" in str(exc.value) and "dpo" in str(exc.value)


def test_unknown_override_key_lists_valid_keys():
    with pytest.raises(GhostvisError) as exc:
        presets.resolve("pretrain", "tiny", {"batch.micro_batch": 4})
    msg = str(exc.value)
    assert "batch.micro_batch" in msg
    assert "micro_batch_size" in msg and "seq_len" in msg  # the valid keys of `batch`


def test_unknown_top_level_override_key():
    with pytest.raises(GhostvisError, match="'bacth' is not in config"):
        presets.resolve("pretrain", "tiny", {"bacth.seq_len": 128})


def test_budget_with_two_keys_is_refused():
    with pytest.raises(GhostvisError) as exc:
        presets.resolve("pretrain", "tiny", {"budget.tokens": 1_000_000})  # preset already sets steps
    msg = str(exc.value)
    assert "exactly one of steps, tokens, tokens_per_param" in msg
    assert "'steps'" in msg and "'tokens'" in msg


def test_budget_with_no_key_is_refused():
    with pytest.raises(GhostvisError, match="exactly one of"):
        presets.resolve("pretrain", "tiny", {"budget.steps": None})


def test_seq_len_above_model_context_is_refused():
    with pytest.raises(GhostvisError, match="max_seq_len=256"):
        presets.resolve("pretrain", "tiny", {"batch.seq_len": 512})


def test_recipe_weights_must_sum_to_one():
    recipe = json.dumps([{"source": "demo_prose", "weight": 0.5}, {"source": "demo_code", "weight": 0.6}])
    with pytest.raises(GhostvisError, match="demo_code=0.6"):
        presets.resolve("pretrain", "tiny", {"data.recipe": recipe})


# ---------------------------------------------------------------- the CLI


def _cli_json(capsys, *args):
    rc = cli_main(["plan", "--json", *args])
    out = capsys.readouterr().out
    assert rc == 0, out
    return json.loads(out)


def test_cli_plan_json_matches_plan_tiny(capsys):
    got = _cli_json(
        capsys,
        "--preset",
        "tiny",
        "--micro-batch-size",
        "4",
        "--seq-len",
        "128",
        "--world-size",
        "4",
        "--grad-accum",
        "3",
        "--tokens",
        "1000000",
        "--step-time",
        "0.5",
        "--price",
        "3",
    )
    cfg = presets.resolve(
        "pretrain",
        "tiny",
        {
            "batch.micro_batch_size": 4,
            "batch.seq_len": 128,
            "batch.world_size": 4,
            "batch.grad_accum_steps": 3,
            "budget.steps": None,
            "budget.tokens": 1_000_000,
        },
    )
    expected = plan(cfg, step_time=StepTime(seconds=0.5), price_per_gpu_hour=3.0).to_dict()
    assert got == {"stage": "pretrain", "preset": "tiny", **expected}
    # and by hand: 4*128*4*3 = 6144 tokens/step; ceil(1e6 / 6144) = ceil(162.76) = 163 steps
    assert got["tokens_per_step"] == 6144 and got["steps"] == 163
    assert got["step_tokens_total"] == 1_001_472  # 163 * 6144
    assert got["flops"] == 6 * TINY_N * 1_001_472
    assert got["gpu_hours"] == pytest.approx(163 * 0.5 * 4 / 3600, rel=1e-12)  # 0.0906 GPU-hours
    assert got["cost"] == pytest.approx(163 * 0.5 * 4 / 3600 * 3, rel=1e-12)


def test_cli_plan_json_matches_plan_gpu_estimate(capsys):
    got = _cli_json(
        capsys,
        "--preset",
        "7b",
        "--micro-batch-size",
        "125",
        "--seq-len",
        "1000",
        "--total-batch-tokens",
        "1000000",
        "--params",
        "208000000",
        "--gpu",
        "A100",
        "--mfu",
        "0.5",
        "--price",
        "2.25",
    )
    expected = plan(
        _seven_b_million_token_steps(),
        params=208_000_000,
        step_time=StepTime(gpu="A100", mfu=0.5),
        price_per_gpu_hour=2.25,
    ).to_dict()
    assert got == {"stage": "pretrain", "preset": "7b", **expected}
    assert got["steps"] == 4160 and got["grad_accum_steps"] == 1
    assert got["cost"] == pytest.approx(4160 * 2.820864e15 / 1.248e15 * 8 / 3600 * 2.25, rel=1e-12)


def test_cli_plan_two_budgets_is_a_one_line_error(capsys):
    rc = cli_main(["plan", "--json", "--steps", "10", "--tokens", "1000"])
    captured = capsys.readouterr()
    assert rc == 2
    assert captured.out == ""
    assert captured.err.startswith("ghostvis: error: give one of --steps, --tokens, --tokens-per-param")
    assert "Traceback" not in captured.err


def test_cli_plan_unknown_preset(capsys):
    rc = cli_main(["plan", "--preset", "huge"])
    captured = capsys.readouterr()
    assert rc == 2 and "unknown preset 'huge'" in captured.err


def test_cli_plan_text_shows_the_four_factors(capsys):
    rc = cli_main(["plan", "--preset", "tiny"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "= 8 x 256 x 2 x 1 = 4,096" in out
    assert re.search(r"steps\s+= 200\b", out)
    assert "819,200" in out
    assert "1.942e+13" in out  # 6 * 3,950,848 * 819,200 = 1.9419e13


# ---------------------------------------------------------------- planner == pre-flight, per source


def _preflight_needed(cfg, p, shard_tokens: int) -> dict[str, int]:
    """The pre-flight's needed tokens per source (`run/preflight.py`, the function the job's check_run calls),
    over LMRows of real SourceStreams whose shards are never opened (only their sizes are read)."""
    from types import SimpleNamespace

    from ghostvis_core.data.loader import Batcher, LMRows
    from ghostvis_core.data.shard_ref import ShardRef
    from ghostvis_core.data.stream import SourceStream
    from ghostvis_core.run.preflight import preflight

    streams = {
        s.source: SourceStream(
            s.source,
            [ShardRef(f"{s.source}/00000", s.source, "train", "/nonexistent", 10, shard_tokens, "sha")],
            seed=0,
        )
        for s in cfg.data.recipe
    }
    batcher = Batcher(
        [LMRows(streams[s.source], cfg.batch.seq_len) for s in cfg.data.recipe], [s.weight for s in cfg.data.recipe]
    )
    report = preflight(cfg, p, SimpleNamespace(batcher=batcher, train_streams=streams))
    return {src: b.needed_tokens for src, b in report.items()}


@pytest.mark.parametrize(
    "recipe, budget",
    [
        ({"demo_prose": 0.5, "demo_code": 0.5}, {}),  # smoke: 24 steps
        ({"demo_prose": 0.6, "demo_code": 0.15, "demo_reasoning": 0.25}, {"budget.steps": 7}),
        ({"demo_prose": 0.333, "demo_code": 0.667}, {"budget.steps": None, "budget.tokens": 122_880}),
    ],
)
def test_planner_needed_tokens_equal_the_preflight_for_lm_stages(recipe, budget):
    cfg = presets.resolve(
        "pretrain",
        "smoke",
        {"data.recipe": json.dumps([{"source": s, "weight": w} for s, w in recipe.items()]), **budget},
    )
    p = plan(cfg)
    planned = {sp.source: sp.needed_tokens for sp in source_plan(recipe, p.step_tokens_total, {}, p.batch.seq_len)}
    assert planned == _preflight_needed(cfg, p, shard_tokens=10**9)
    # rows x seq_len over all sources is the step total; each source read adds its one boundary token
    assert sum(planned.values()) == p.step_tokens_total + len(recipe)


def test_planner_needed_tokens_by_hand():
    # smoke pretrain: 24 steps x 16 rows (8 x 2 x 1) = 384 rows; 0.5/0.5 -> 192 rows per source
    # 192 x 256 = 49,152 positions + 1 boundary token (the last row's last target) = 49,153
    got = source_plan({"a": 0.5, "b": 0.5}, 24 * 4096, {"a": [("a/0", 49_153)]}, seq_len=256)
    assert [sp.needed_tokens for sp in got] == [49_153, 49_153]
    assert got[0].epochs == 1.0 and got[0].shards == ["a/0"]  # exactly one epoch: the file holds 49,153
    assert lm_tokens_for_rows(0, 256) == 0  # a source never read needs no boundary token
    # without seq_len (a non-LM stage) the split by weight stays: an estimate
    assert [sp.needed_tokens for sp in source_plan({"a": 0.5, "b": 0.5}, 24 * 4096, {})] == [49_152, 49_152]


def test_cli_plan_recipe_says_why_needed_has_one_more_token(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("GHOSTVIS_HOME", str(tmp_path))
    got = _cli_json(capsys, "--preset", "smoke", "--recipe", "demo_prose=0.5,demo_code=0.5")
    # smoke pretrain: 24 steps x 4 x 256 x 2 = 49,152 tokens, half to each source, + 1 boundary token each
    assert [s["needed_tokens"] for s in got["sources"]] == [24_577, 24_577]
    assert got["needed_tokens_rule"] == LM_NEEDED_RULE
    assert cli_main(["plan", "--preset", "smoke", "--recipe", "demo_prose=0.5,demo_code=0.5"]) == 0
    out = capsys.readouterr().out
    assert "24,577" in out and "needed = rows x seq_len + 1 boundary token per source: the last target token" in out

"""Run modes: the steps and tokens of "N hours on G GPUs" come from the planner, never typed in.

Each mode states a model preset, a GPU, a GPU count, hours and an MFU; the tests check that the
derived steps spend the stated hours (steps x tokens/step x FLOPs/token / (GPUs x peak x MFU)), that
each mode's model fits its GPU, that a mode launches through the usual preset/overrides path, and
that the planner computes the token arithmetic a common guide gets wrong.
"""

from __future__ import annotations

import json
import math

import pytest

from ghostvis_core.errors import GhostvisError
from ghostvis_core.plan import presets
from ghostvis_core.plan.batch import BatchPlan
from ghostvis_core.plan.budget import GPUS, StepTime, memory_plan, plan
from ghostvis_core.plan.config import BudgetConfig
from ghostvis_core.plan.run_modes import MODES, model_preset
from ghostvis_pipeline.cli import main as cli_main
from ghostvis_pipeline.cli import plan_mode


@pytest.mark.parametrize("name", list(MODES))
def test_a_modes_steps_spend_its_stated_hours_at_its_mfu(name):
    mode, p = MODES[name], plan_mode(name)
    assert (p.batch.world_size, p.memory["fit"]["gpu"]) == (mode.gpus, mode.gpu)
    seconds = p.steps * p.batch.tokens_per_step * p.flops_per_token / (mode.gpus * GPUS[mode.gpu].bf16_flops * mode.mfu)
    step_s = seconds / p.steps
    # the whole steps that fit: within one step of the target, never beyond it
    assert mode.hours * 3600 - step_s < seconds <= mode.hours * 3600
    assert p.hours == pytest.approx(seconds / 3600, rel=1e-12)
    assert p.step_tokens_total == p.steps * p.batch.tokens_per_step


@pytest.mark.parametrize("name", list(MODES))
def test_each_modes_model_fits_its_gpu(name):
    mode = MODES[name]
    mp = memory_plan(presets.resolve("pretrain", name), gpu=mode.gpu)
    assert mp.fit.fits and mp.world_size == mode.gpus and mp.total_gb <= GPUS[mode.gpu].memory_gb * 0.9


def test_one_h100_for_4_hours_by_hand():
    """500m: N = 520,418,560 non-embedding; FLOPs/token = 6N + 12 x 24 layers x 1280 x 2048 positions
    = 3,877,486,080; 524,288 tokens/step (8 x 2048 x 1 GPU x 32 accumulation) at 989e12 x 0.4 FLOP/s
    = 5.139 s per step; 14,400 s / 5.139 = 2,802.2 -> 2,802 steps, 1,469,054,976 tokens."""
    p = plan_mode("1xh100-4h")
    assert p.flops_per_token == 6 * 520_418_560 + 12 * 24 * 1280 * 2048 == 3_877_486_080
    assert p.batch == BatchPlan(8, 2048, 1, 32)
    assert p.steps == math.floor(4 * 3600 / (3_877_486_080 * 524_288 / (989e12 * 0.4))) == 2_802
    assert p.step_tokens_total == 1_469_054_976


def test_the_planner_computes_a_guides_iterations_from_its_tokens():
    """A guide promises "71,680 iterations" for 11.2B tokens at 524,288 tokens per step; the planner
    says 11.2e9 / 524,288 = 21,362.3, rounded up so the run covers the budget: 21,363 steps."""
    cfg = presets.resolve("pretrain", "500m", {"budget.tokens_per_param": None, "budget.tokens": 11_200_000_000})
    p = plan(cfg)
    assert p.batch.tokens_per_step == 524_288 and p.steps == 21_363
    assert p.step_tokens_total - 11_200_000_000 < 524_288
    assert 71_680 * 524_288 == 37_580_963_840  # the guide's iterations would train 3.4x the tokens


def test_overrides_apply_before_the_planner_derives_the_steps():
    """A shorter context costs fewer attention FLOPs per token, so the same hours buy more steps."""
    base = plan_mode("1xh100-1h")
    short = plan_mode("1xh100-1h", overrides={"batch.seq_len": "1024"})
    assert short.batch.seq_len == 1024 and short.batch.grad_accum_steps == 64
    assert short.batch.tokens_per_step == base.batch.tokens_per_step
    assert short.flops_per_token == base.flops_per_token - 12 * 24 * 1280 * 1024
    assert short.steps > base.steps and short.hours <= 1.0


def test_a_budget_or_world_size_override_contradicts_the_mode():
    with pytest.raises(
        GhostvisError,
        match=r"run mode 1xh100-4h: budget.steps is derived from the mode "
        r"\(1 x H100, 4 h at MFU 0.4\); drop it, or use the model preset 500m",
    ):
        presets.resolve("pretrain", "1xh100-4h", {"budget.steps": "10"})
    with pytest.raises(GhostvisError, match="batch.world_size is derived from the mode"):
        presets.resolve("pretrain", "8xh100-4h", {"batch.world_size": 4})


def test_a_mode_whose_model_does_not_fit_is_refused_with_the_numbers_and_the_fix():
    with pytest.raises(GhostvisError) as exc:
        presets.resolve("pretrain", "1xa100-1h", {"batch.micro_batch_size": 64})
    msg = str(exc.value)
    assert msg.startswith("run mode 1xa100-1h: stage pretrain: ")
    assert "does not fit A100 (72.0 of 80 GB usable) on 1 GPUs; fix:" in msg


def test_a_mode_resolves_once_to_its_model_preset_and_world_size(monkeypatch):
    """One pass: the mode's preset and world size go in, the priced config comes out; the config is built once."""
    built = []
    base = presets._base
    monkeypatch.setattr(presets, "_base", lambda *a: built.append(a) or base(*a))
    cfg = presets.resolve("pretrain", "8xh100-12h", {"batch.seq_len": "1024"})
    assert [a[:2] for a in built] == [("pretrain", "1.5b")]
    assert (cfg.preset, cfg.batch.world_size, cfg.batch.seq_len) == ("1.5b", 8, 1024)
    assert cfg.budget == BudgetConfig(steps=plan_mode("8xh100-12h", overrides={"batch.seq_len": "1024"}).steps)
    assert presets.resolve("pretrain", "tiny", {"budget.steps": 5}).budget == BudgetConfig(steps=5)
    assert (model_preset("8xh100-12h"), model_preset("7b")) == ("1.5b", "7b")


def test_cli_plan_mode_json_is_the_planners_plan(capsys):
    assert cli_main(["plan", "--mode", "8xh100-12h", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    expected = plan_mode("8xh100-12h").to_dict()
    assert got == {"stage": "pretrain", "preset": "1.5b", "run_mode": "8xh100-12h", **expected}
    assert got["memory"]["strategy"] == "fsdp" and got["memory"]["fit"]["fits"] is True
    assert cli_main(["plan", "--preset", "8xh100-12h", "--json"]) == 0  # a mode's name works as a preset
    assert json.loads(capsys.readouterr().out) == got


def test_cli_plan_modes_lists_every_mode_with_the_derived_figures(capsys):
    assert cli_main(["plan", "--modes", "--json"]) == 0
    rows = {r["mode"]: r for r in json.loads(capsys.readouterr().out)}
    assert list(rows) == list(MODES)
    for name, r in rows.items():
        p = plan_mode(name)
        assert (r["steps"], r["tokens"], r["fits"]) == (p.steps, p.step_tokens_total, True)
        assert r["hours"] == pytest.approx(MODES[name].hours, abs=p.step_time_s / 3600)
    assert cli_main(["plan", "--modes"]) == 0
    out = capsys.readouterr().out
    assert "1xh100-4h      500m    2,802     524,288    1,469,054,976" in out


def test_cli_plan_mode_refuses_hardware_flags_it_states(capsys):
    assert cli_main(["plan", "--mode", "1xh100-4h", "--gpu", "A100", "--mfu", "0.5"]) == 2
    err = capsys.readouterr().err
    assert (
        "run mode 1xh100-4h states the hardware and hours (500m on 1 x H100 (989 TFLOP/s bf16) for 4 h at MFU "
        "0.4); drop --gpu, --mfu, or plan --preset 500m with them" in err
    )


def test_a_stage_launched_with_a_mode_trains_the_planners_steps(demo_home, monkeypatch):
    """`ghostvis train pretrain --preset 1xh100-1h` (or run config preset: 1xh100-1h) resolves through
    plan_run: the spec carries the mode's world size and the steps the planner derived for the model that
    trains. Its vocabulary is the demo tokenizer's 4,096, not the preset's, so fewer FLOPs per token buy
    more steps in the hour (797) than the preset alone plans (700)."""
    from ghostvis_core.home import Home
    from ghostvis_core.launch.start import plan_run

    monkeypatch.setenv("GHOSTVIS_HOME", str(demo_home))
    monkeypatch.delenv("GHOSTVIS_STORE", raising=False)
    planned = plan_run("pretrain", preset="1xh100-1h", overrides={"checkpoint.every_steps": "50"}, home=Home.from_env())
    cfg = planned.resolved.cfg
    assert cfg.preset == "500m" and cfg.batch.world_size == 1
    assert cfg.model.vocab_size == 4096 and cfg.budget == BudgetConfig(steps=797)
    assert cfg.checkpoint.every_steps == 50 and planned.preset == "1xh100-1h"  # the MLflow tag's preset
    hour = plan(cfg, step_time=StepTime(gpu="H100", mfu=0.4))
    assert planned.plan.steps == hour.steps == 797 and 1 - hour.step_time_s / 3600 < hour.hours <= 1
    assert plan_mode("1xh100-1h").steps == 700

"""`ghostvis plan --mtbf-hours`: the recommended checkpoint interval is Daly's (checked against figures worked out
by hand), the expected goodput is backed by a seeded Monte Carlo of the same failures, the recommended interval is
the simulated optimum among its neighbours, and the CLI prints and refuses as docs/goodput.md says."""

from __future__ import annotations

import json
import math

import pytest

from ghostvis_core.plan.goodput import (
    FailureModel,
    daly_interval_s,
    expected_goodput,
    segments,
    simulate,
    young_interval_s,
)
from ghostvis_core.runs.lookup import newest_completed_run
from ghostvis_core.store import open_store
from ghostvis_pipeline.cli import main

# A seeded case: 400 h of steps, a job failing every 4 h on average, a 2 min save and a 15 min restart.
WORK_S = 400 * 3600
CASE = FailureModel(save_s=120, restart_s=900, job_mtbf_s=4 * 3600)
TRIALS, SEED = 100, 11


def test_the_recommended_interval_is_dalys_worked_by_hand():
    # d = 60 s, M = 10,000 s: sqrt(2 d M) = sqrt(1,200,000) = 1095.445; x = d / 2M = 0.003;
    # 1 + sqrt(x) / 3 + x / 9 = 1 + 0.0182574 + 0.0003333 = 1.0185907; 1095.445 x 1.0185907 - 60 = 1055.810
    fm = FailureModel(save_s=60, restart_s=300, job_mtbf_s=10_000)
    assert young_interval_s(fm) == pytest.approx(1095.445, abs=1e-3)
    assert daly_interval_s(fm) == pytest.approx(1055.810, abs=1e-3)
    # d = 300 s, M = 7,200 s: sqrt(4,320,000) = 2078.461; x = 0.0208333; 1 + 0.0481125 + 0.0023148 = 1.0504273;
    # 2078.461 x 1.0504273 - 300 = 1883.272
    fm = FailureModel(save_s=300, restart_s=600, job_mtbf_s=7_200)
    assert daly_interval_s(fm) == pytest.approx(1883.272, abs=1e-3)
    # a save as long as two MTBFs: checkpoint once per MTBF
    assert daly_interval_s(FailureModel(save_s=500, restart_s=0, job_mtbf_s=250)) == 250


def test_the_last_segment_holds_the_rest_and_ends_with_the_final_save():
    assert segments(1000, 300, 10).lengths() == [310, 310, 310, 110]
    assert segments(900, 300, 10).lengths() == [310, 310, 310]
    assert segments(100, 300, 10).lengths() == [110]


# A restart half as long as the MTBF: 1 - e^-0.5 = 39% of restarts are themselves struck by a failure.
SLOW_RESTART = FailureModel(save_s=300, restart_s=3600, job_mtbf_s=2 * 3600)


@pytest.mark.parametrize("fm, low, high", [(CASE, 0.75, 0.9), (SLOW_RESTART, 0.3, 0.5)])
def test_the_expected_goodput_is_the_simulated_mean_of_a_seeded_case(fm, low, high):
    interval = daly_interval_s(fm)
    sim = simulate(WORK_S, interval, fm, TRIALS, SEED)
    formula = expected_goodput(WORK_S, interval, fm)
    # within half a point, and within 3 standard errors of the simulated mean
    assert abs(sim.goodput_mean - formula) < 0.005
    assert abs(sim.goodput_mean - formula) < 3 * sim.goodput_stderr
    assert low < formula < high  # a case where failures cost something: hundreds expected per run
    assert sim.failures_mean == pytest.approx(WORK_S / formula / fm.job_mtbf_s, rel=0.05)
    assert simulate(WORK_S, interval, fm, TRIALS, SEED) == sim  # seeded: the same draws


def test_the_recommended_interval_is_the_simulated_optimum_among_its_neighbours():
    daly = daly_interval_s(CASE)
    factors = [0.5, 0.63, 0.79, 1.0, 1.26, 1.59, 2.0]
    sims = {f: simulate(WORK_S, daly * f, CASE, TRIALS, SEED) for f in factors}
    best = max(factors, key=lambda f: sims[f].goodput_mean)
    assert 0.79 <= best <= 1.26, {f: round(s.goodput_mean, 4) for f, s in sims.items()}
    assert sims[1.0].goodput_mean >= sims[best].goodput_mean - 2 * sims[1.0].goodput_stderr
    assert sims[1.0].goodput_mean - min(s.goodput_mean for s in sims.values()) > 0.02  # the curve is not flat


def plan(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["plan", "--preset", "tiny", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


LLAMA3 = "--world-size 16384 --gpus-per-node 8 --step-time 6 --hours 1296".split()
LLAMA3_FAILURES = "--mtbf-hours 5695.7 --save-seconds 30 --restart-seconds 300".split()


def test_plan_recommends_every_steps_and_minutes_from_the_job_mtbf(capsys):
    rc, out, _ = plan(capsys, *LLAMA3, *LLAMA3_FAILURES, "--json")
    g = json.loads(out)["goodput"]
    assert rc == 0
    assert g["nodes"] == 2048 and g["job_mtbf_hours"] == pytest.approx(5695.7 / 2048)
    fm = FailureModel(30, 300, 5695.7 / 2048 * 3600)
    assert g["daly_interval_s"] == pytest.approx(daly_interval_s(fm))
    assert g["every_steps"] == round(daly_interval_s(fm) / 6) == 126
    assert g["every_minutes"] == pytest.approx(126 * 6 / 60)
    assert g["goodput"] == pytest.approx(expected_goodput(1296 * 3600, 126 * 6, fm))
    assert g["configured_every_steps"] == 100  # the preset's checkpoint.every_steps, as planned today
    assert g["figures"]["save_from"] == "given: --save-seconds"
    assert g["figures"]["gpus_per_node_from"] == "given: --gpus-per-node"

    rc, out, _ = plan(capsys, *LLAMA3, *LLAMA3_FAILURES, "--set", "checkpoint.every_steps=126")
    assert rc == 0
    assert "goodput now     = 89.73%  (a checkpoint every 756 s: checkpoint.every_steps=126)" in out
    assert "recommended     = --set checkpoint.every_steps=126 (or checkpoint.every_minutes=12.6)" in out
    assert "= 2.781 h" in out and "(given: --restart-seconds)" in out


def test_an_unstated_gpus_per_node_is_said_to_be_assumed(capsys):
    args = "--world-size 12 --step-time 2 --steps 1000 --mtbf-hours 100 --save-seconds 5 --restart-seconds 60"
    rc, out, _ = plan(capsys, *args.split())
    assert rc == 0
    assert "100 h per node / 2 nodes (ceil(12 GPUs / 8 per node, assumed: 8 per node)) = 50.000 h" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--steps", "10", "--mtbf-hours", "10", "--save-seconds", "5", "--restart-seconds", "5"],
            "--mtbf-hours needs a step time: pass --step-time S (measured) or --gpu",
        ),
        (
            ["--step-time", "1", "--steps", "10", "--mtbf-hours", "10", "--restart-seconds", "5"],
            "run records do not measure it; pass --save-seconds S",
        ),
        (
            ["--step-time", "1", "--steps", "10", "--mtbf-hours", "10", "--save-seconds", "5"],
            "has no completed pretrain run to measure it from; pass --restart-seconds S",
        ),
        (
            ["--step-time", "1", "--steps", "10", "--mtbf-hours", "0", "--save-seconds", "5", "--restart-seconds", "5"],
            "--mtbf-hours 0: the goodput plan needs above 0",
        ),
        (
            [
                "--step-time",
                "1",
                "--steps",
                "10",
                "--mtbf-hours",
                "0.001",
                "--save-seconds",
                "2",
                "--restart-seconds",
                "1000",
                "--world-size",
                "80",
            ],
            "a job MTBF of 0.36 s against a 1000 s restart and a 2 s save: failures come so much sooner",
        ),
    ],
)
def test_missing_or_hopeless_figures_are_refused_naming_the_flag(capsys, tmp_path, monkeypatch, args, message):
    monkeypatch.setenv("GHOSTVIS_HOME", str(tmp_path / "empty"))
    rc, _, err = plan(capsys, *args)
    assert rc == 2 and message in err


@pytest.mark.e2e
def test_the_restart_time_is_measured_from_the_newest_completed_run(demo_home, monkeypatch, capsys):
    monkeypatch.setenv("GHOSTVIS_HOME", str(demo_home))
    monkeypatch.delenv("GHOSTVIS_STORE", raising=False)
    store = open_store(str(demo_home / "store"))
    record = newest_completed_run(store, "pretrain")
    first_step_s = store.read_json("run_record", "pretrain", record.run_key)["first_step_s"]  # the record as written
    assert first_step_s > 0
    rc, out, _ = plan(capsys, *"--step-time 1 --steps 1000 --mtbf-hours 10 --save-seconds 2 --json".split())
    g = json.loads(out)["goodput"]
    assert rc == 0
    assert g["figures"]["restart_s"] == first_step_s
    assert g["figures"]["restart_from"] == (
        f"measured: first_step_s of pretrain run {record.run_key}, segment {record.segment}"
    )
    assert math.isfinite(g["goodput"]) and 0 < g["goodput"] < 1

"""The replay (ghostvis_core/verify/replay): sampled checkpoint intervals of a run re-executed from the checkpoint
before them on the ledger's recorded rows, compared bit for bit with the checkpoint after them.

Planted bugs (tests/planted.py) that every record-based check passes: a trainer that trains on other rows than it
records (its digests those of the planned rows), one that skips one optimizer step, one that scales one
micro-batch's loss. Each runs on the grad-accumulation smoke pretrain of tests/test_audit.py (4 steps, 2 ranks x 2
micro-batches, a checkpoint every 2 steps: intervals 1..2 from the seeded weights and 3..4 from step 2); the audit's
checks pass on each, the replay names the interval the bug sits in and passes the other.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ghostvis_core.data.ledger import Ledger
from ghostvis_core.home import Home
from ghostvis_core.runs.lookup import newest_completed_run
from ghostvis_core.verify.audit.invariants import StageRun
from ghostvis_core.verify.replay.check import NAME, kept_verdict, replay_matches
from ghostvis_core.verify.replay.intervals import Interval, choose, intervals
from ghostvis_core.verify.replay.record import record_path, replay_summary, write_record
from ghostvis_core.verify.replay.refusal import refusal
from ghostvis_core.verify.replay.settings import ReplaySettings
from tests.conftest import copy_home, run_cli
from tests.test_audit import SMOKE_ACCUM, checks_of, failed, launch

BUGS = ["fed_other_rows_than_recorded", "optimizer_step_skipped_once", "one_micro_batch_loss_scaled"]
# bug -> the intervals whose replay differs (the other one starts from the buggy run's own checkpoint)
DIFFERING = {
    "fed_other_rows_than_recorded": {"steps 1..2", "steps 3..4"},
    "optimizer_step_skipped_once": {"steps 3..4"},
    "one_micro_batch_loss_scaled": {"steps 1..2"},
}


def test_the_intervals_run_from_the_starting_weights_to_each_kept_checkpoint():
    assert intervals([12, 24]) == [Interval(1, 12), Interval(13, 24)]
    assert intervals([24]) == [Interval(1, 24)]  # one final checkpoint: the run replayed whole


def test_the_choice_is_seeded_and_always_holds_the_last_interval():
    candidates = intervals([2, 4, 6, 8, 10])
    for seed in range(20):
        chosen = choose(candidates, 3, seed)
        assert len(chosen) == 3 and chosen[-1] == Interval(9, 10) and chosen == sorted(chosen, key=lambda i: i.first)
        assert chosen == choose(candidates, 3, seed)
    assert len({tuple(choose(candidates, 2, seed)) for seed in range(20)}) > 1
    assert choose(candidates, 9, 0) == candidates
    assert choose(candidates, 0, 0) == []


def stage_run(home: Path, stage: str, run_key: str | None = None) -> StageRun:
    h = Home(home)
    key = run_key or newest_completed_run(h.store, stage).run_key
    return StageRun.load(h.store, Ledger.in_store(h.store), stage, key)


def test_runs_a_replay_cannot_repeat_bit_for_bit_are_refused_by_name(home_copy):
    rl = stage_run(home_copy, "rl")
    outcome = replay_matches(Home(home_copy).store, rl, ReplaySettings(1, 0))
    assert not outcome.passed and outcome.figures["intervals_replayed"] == 0
    assert outcome.failures == [f"rl run {rl.spec.run_key} cannot be replayed bit for bit: {refusal(rl)}"]
    assert "objective grpo" in outcome.failures[0]
    assert replay_summary(Home(home_copy).store, "rl", rl.spec.run_key) == "not replayable bit for bit"
    run = stage_run(home_copy, "pretrain")
    assert refusal(run) is None
    cfg = run.spec.config
    fsdp = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, strategy="fsdp"))
    four = [dataclasses.replace(p, world_size=4) for p in run.chain]
    cases = {
        "parallel.strategy=fsdp": dataclasses.replace(run, spec=dataclasses.replace(run.spec, config=fsdp)),
        "it trained on 4 ranks": dataclasses.replace(run, chain=four),
        "it trained on CUDA": dataclasses.replace(run, record=dataclasses.replace(run.record, cuda_peak_memory_gb=3.2)),
        "world sizes [2, 4]": dataclasses.replace(run, chain=run.chain[:1] + four[1:]),
    }
    for words, changed in cases.items():
        assert words in refusal(changed), (words, refusal(changed))
    store = Home(home_copy).store
    store.delete("report", record_path("pretrain", run.spec.run_key))  # the demo's own replay_matches left one
    assert replay_summary(store, "pretrain", run.spec.run_key).startswith("not replayed")
    none = replay_matches(Home(home_copy).store, run, ReplaySettings(0, 0))
    assert not none.passed and none.failures == [
        f"pretrain run {run.spec.run_key}: 0 intervals asked for; replay at least 1 (of 2)"
    ]


@pytest.fixture(scope="module")
def replayed(demo_home, module_tmp) -> tuple[Path, dict[str, str]]:
    """(home, scenario -> run key): a clean grad-accumulation smoke pretrain and one per planted bug, in one
    torchrun launch on a copy of the demo home; the last one (the scaled loss) is the stage's newest run."""
    home = module_tmp("replay") / "home"
    copy_home(demo_home, home)
    scenarios = [("clean", None, 51, SMOKE_ACCUM)] + [(b, b, seed, SMOKE_ACCUM) for seed, b in enumerate(BUGS, 52)]
    return home, launch(home, scenarios)


def replay(home: Path, run_key: str):
    return replay_matches(Home(home).store, stage_run(home, "pretrain", run_key), ReplaySettings(2, 0))


@pytest.mark.e2e
def test_a_clean_grad_accumulation_run_replays_bit_for_bit_interval_by_interval(replayed):
    home, keys = replayed
    outcome = replay(home, keys["clean"])
    assert outcome.passed and not outcome.failures, outcome.failures
    f = outcome.figures
    assert (f["intervals_available"], f["intervals_replayed"], f["intervals_bitwise_equal"], f["steps_replayed"]) == (
        2,
        2,
        2,
        4,
    )
    assert f["summary"] == "2 intervals replayed (steps 1..2, 3..4), bitwise equal"
    rows = outcome.tables["intervals"][1]
    assert [r[:3] for r in rows] == [
        ["steps 1..2", "starting weights", "bitwise equal"],
        ["steps 3..4", "step 2", "bitwise equal"],
    ]
    compared = {r[4] for r in rows}
    assert len(compared) == 1 and compared.pop().startswith("0 / ")
    assert f["replay_s_per_step"] > 0 and f["train_s_per_step"] > 0
    assert replay_summary(Home(home).store, "pretrain", keys["clean"]) == f["summary"]


@pytest.mark.e2e
@pytest.mark.parametrize("bug", BUGS)
def test_a_planted_training_bug_that_every_other_check_passes_fails_the_replay_of_its_interval(replayed, bug):
    home, keys = replayed
    key = keys[bug]
    assert failed(checks_of(home, key)) == set()  # the records are the plan's: every audit check passes
    outcome = replay(home, key)
    assert not outcome.passed
    rows = outcome.tables["intervals"][1]
    assert {r[0] for r in rows if r[2] == "DIFFERS"} == DIFFERING[bug], rows
    assert {r[0] for r in rows if r[2] == "bitwise equal"} == {"steps 1..2", "steps 3..4"} - DIFFERING[bug]
    starts = {"steps 1..2": "the starting weights", "steps 3..4": "checkpoint step 2"}
    assert sorted(f.split(": first differing tensor")[0] for f in outcome.failures) == [
        f"pretrain run {key} interval {name}: the replay from {starts[name]} differs from checkpoint step {name[-1]}"
        for name in sorted(DIFFERING[bug])
    ]
    assert all("largest difference" in f for f in outcome.failures)


@pytest.mark.e2e
def test_the_audit_exits_0_on_a_scaled_micro_batch_loss_and_1_with_the_replay_naming_the_interval(replayed):
    home, keys = replayed
    key = keys["one_micro_batch_loss_scaled"]
    plain = run_cli(["ghostvis", "audit", "--stage", "pretrain", "--no-dagster"], home)
    assert f"pretrain  {key}" in plain.stdout and "every figure agrees" in plain.stdout
    proc = run_cli(["ghostvis", "audit", "--stage", "pretrain", "--no-dagster", "--replay", "2"], home, check=False)
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "FAIL replay_matches: 2 intervals replayed (steps 1..2, 3..4), 1 bitwise equal" in proc.stdout
    named = f"pretrain: replay_matches: pretrain run {key} interval steps 1..2: the replay from the starting weights"
    assert named in proc.stdout, proc.stdout[-3000:]
    assert "interval steps 3..4" not in proc.stdout


@pytest.mark.e2e
def test_the_demo_pretrain_and_sft_replay_bit_for_bit(home_copy):
    proc = run_cli(["ghostvis", "audit", "--stage", "pretrain", "--stage", "sft", "--replay", "2"], home_copy)
    assert "every figure agrees" in proc.stdout, proc.stdout[-3000:]
    lines = [line.strip() for line in proc.stdout.splitlines() if "replay_matches" in line]
    assert lines == [
        "ok   replay_matches: 2 intervals replayed (steps 1..12, 13..24), bitwise equal",
        "ok   replay_matches: 2 intervals replayed (steps 1..4, 5..8), bitwise equal",
    ]


@pytest.mark.e2e
def test_the_dagster_check_replays_the_intervals_its_config_asks_for_and_the_report_card_shows_it(home_copy):
    from dagster import AssetCheckKey, AssetKey, AssetSelection, DagsterInstance, Definitions, define_asset_job

    from ghostvis_core.verify.eval.report_card import render_markdown, tables
    from ghostvis_pipeline.definitions import defs
    from tests.test_quality_gate import stage_card

    job = define_asset_job("replay", selection=AssetSelection.checks(AssetCheckKey(AssetKey("pretrain"), NAME)))
    with_job = Definitions(
        assets=defs.assets, asset_checks=defs.asset_checks, jobs=[job], resources=defs.resources, executor=defs.executor
    )
    config = {"ops": {f"pretrain_{NAME}": {"config": {"intervals": 1, "seed": 0}}}}
    env = {"GHOSTVIS_HOME": str(home_copy), "DAGSTER_HOME": str(home_copy / "dagster"), "GHOSTVIS_PRESET": "smoke"}
    with pytest.MonkeyPatch.context() as patches:
        for k, v in env.items():
            patches.setenv(k, v)
        with DagsterInstance.get() as instance:
            result = with_job.resolve_job_def("replay").execute_in_process(instance=instance, run_config=config)
    (evaluation,) = result.get_asset_check_evaluations()
    figures = {k: getattr(v, "value", v) for k, v in evaluation.metadata.items()}
    assert evaluation.passed and figures["summary"] == "1 interval replayed (steps 13..24), bitwise equal"
    assert (figures["intervals_available"], figures["steps_replayed"], figures["seed"]) == (2, 12, 0)
    key = stage_run(home_copy, "pretrain").spec.run_key
    summary = replay_summary(Home(home_copy).store, "pretrain", key)
    assert summary == figures["summary"]
    card = [stage_card("pretrain", run_key=key, replay=summary), stage_card("dpo")]
    header, rows = tables(card)["Replay (sampled checkpoint intervals re-executed, compared bit for bit)"]
    assert rows == [["pretrain", key, summary], ["dpo", "dpo-r1", "-"]]
    assert f"| pretrain | {key} | {summary} |" in render_markdown("t", card, "c.png", {})


@pytest.mark.e2e
def test_a_cache_hit_keeps_the_runs_replay_verdict_only_for_the_same_seed_and_intervals(home_copy):
    """The demo's check replayed pretrain's last interval (1 interval, seed 0): a cache hit of that run keeps
    that verdict, passed or failed, and any other setting replays again."""
    store, run = Home(home_copy).store, stage_run(home_copy, "pretrain")
    key = run.spec.run_key
    kept = kept_verdict(store, run, ReplaySettings(1, 0))
    assert kept.passed and kept.figures["summary"] == (
        "1 interval replayed (steps 13..24), bitwise equal (kept from the run's first replay: a cache hit)"
    )
    assert kept.tables["intervals"][1][0][:3] == ["steps 13..24", "step 12", "bitwise equal"]
    assert kept_verdict(store, run, ReplaySettings(2, 0)) is None  # two intervals asked, one replayed
    assert kept_verdict(store, run, ReplaySettings(1, 1)) is None  # another seed draws other intervals
    failed_once = dataclasses.replace(kept, passed=False, failures=[f"pretrain run {key} interval steps 13..24: x"])
    write_record(store, "pretrain", key, failed_once.to_dict())
    again = kept_verdict(store, run, ReplaySettings(1, 0))
    assert not again.passed and again.failures == failed_once.failures
    header, rows = kept.tables["intervals"]
    crashed = dataclasses.replace(kept, passed=False, tables={"intervals": (header, [[*rows[0][:2], "not replayed"]])})
    write_record(store, "pretrain", key, crashed.to_dict())
    assert kept_verdict(store, run, ReplaySettings(1, 0)) is None  # its replay process failed: replayed again

"""Where the audit takes its facts from (issue 24, items 3-5): splits from the ledger's shard table,
never from a label the trainer wrote; every MLflow point of the token metrics, not only the newest;
and messages that name the parts, segments and steps that read a range.

Unit tests write a ledger by hand (`Ledger.write_shard` / `write_part` into a tmp folder); the
e2e tests run one 4-step smoke pretrain (2 ranks, grad_accum 2: 512 tokens per step, a checkpoint
every 2 steps) in a copy of the demo home, and plant a bug in the launching process.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.ledger.records import SelectedNotTrain
from ghostvis_core.data.ledger.summaries import validation_selected
from ghostvis_core.data.shard_ref import ShardRef
from ghostvis_core.data.stream import SourceStream
from ghostvis_core.errors import GhostvisError
from ghostvis_core.run.preflight import stream_split_problems
from ghostvis_core.verify.audit import invariants as inv
from tests.ledger_rows import part, piece, shard_record, write

TPS = 512  # tokens per step of the histories below: 2 x 64 x 2 ranks x 2 micro-batches


@pytest.fixture
def ledger(tmp_path) -> Ledger:
    ledger = Ledger(tmp_path / "ledger")
    ledger.write_shard(shard_record("demo_prose/00000"))
    ledger.write_shard(shard_record("demo_prose/00009", split="validation"))
    return ledger


# ---------------------------------------------------------------- splits from the ledger


def test_a_validation_shard_consumed_under_a_train_label_is_leakage(ledger):
    write(
        ledger,
        part("l.p0", "l"),
        [piece("demo_prose/00000", (0, 100), (0, 10)), piece("demo_prose/00009", (0, 30), (0, 3), split="train")],
    )
    outcome = inv.no_validation_leakage(ledger, "l", "tok-a")
    assert not outcome.passed
    assert outcome.failures == [
        "shard demo_prose/00009 consumed in training (30 tokens, rows 0..3) is not train "
        "(ledger shard table: validation; the trainer labelled it train)"
    ]
    assert outcome.tables["leaked"][1] == [["demo_prose/00009", "validation", "train", 30, "0..3"]]


def test_a_consumed_shard_the_shard_table_does_not_know_fails_too(ledger):
    write(
        ledger,
        part("u.p0", "u"),
        [piece("demo_prose/00000", (0, 100), (0, 10)), piece("demo_web/00000", (0, 40), (0, 4))],
    )
    outcome = inv.no_validation_leakage(ledger, "u", "tok-a")
    assert outcome.failures == [
        "shard demo_web/00000 consumed in training (40 tokens, rows 0..4) is not train "
        "(ledger shard table: not in the ledger; the trainer labelled it train)"
    ]
    # the shard table of another tokenizer does not vouch for this run's shards
    assert [r.consumed.shard_id for r in ledger.leakage("u", "tok-b")] == ["demo_prose/00000", "demo_web/00000"]
    ledger.write_shard(shard_record("demo_web/00000", source="web"))
    assert inv.no_validation_leakage(ledger, "u", "tok-a").passed


def test_a_consumed_shard_is_judged_by_the_version_the_run_read_not_a_newer_one(ledger):
    """demo_prose/00000 changed under its name since the run read it (sha-1, train): its new version (sha-2)
    is pinned as validation. The run is judged by the version it read; a run that read sha-2 leaks."""
    ledger.write_shard(shard_record("demo_prose/00000", sha="sha-2", split="validation", created_at=2.0))
    write(ledger, part("v.p0", "v"), [piece("demo_prose/00000", (0, 100), (0, 10))])
    assert inv.no_validation_leakage(ledger, "v", "tok-a", {"demo_prose/00000": "sha-1"}).passed
    assert not inv.no_validation_leakage(ledger, "v", "tok-a").passed  # the newest record says validation
    outcome = inv.no_validation_leakage(ledger, "v", "tok-a", {"demo_prose/00000": "sha-2"})
    assert outcome.failures == [
        "shard demo_prose/00000 consumed in training (100 tokens, rows 0..10) is not train "
        "(ledger shard table: validation; the trainer labelled it train)"
    ]
    unknown = inv.no_validation_leakage(ledger, "v", "tok-a", {"demo_prose/00000": "sha-3"})
    assert unknown.figures["leaked_shards"] == "demo_prose/00000" and "not in the ledger" in unknown.failures[0]


def test_a_selected_shard_labelled_train_in_the_spec_is_judged_by_the_ledger(ledger):
    selected = {
        "prose": (
            ShardRef("demo_prose/00000", "prose", "validation", "", 1, 1, "sha-1"),
            ShardRef("demo_prose/00009", "prose", "train", "", 1, 1, "sha-1"),
        )
    }
    assert validation_selected(ledger, "tok-a", selected) == [
        SelectedNotTrain(source="prose", shard_id="demo_prose/00009", split="validation", spec_split="train")
    ]


def test_each_stream_holds_only_shards_of_its_split_by_the_ledger(ledger):
    def stream(*ids: str) -> SourceStream:  # each ref labelled by the stream it is in, as a merge bug would
        return SourceStream("demo_prose", [ShardRef(i, "demo_prose", "train", "", 10, 100) for i in ids], 1)

    splits = ledger.shard_splits("tok-a")
    assert (
        stream_split_problems(
            splits,
            {
                "train": {"demo_prose": stream("demo_prose/00000")},
                "validation": {"demo_prose": stream("demo_prose/00009")},
            },
        )
        == []
    )
    assert stream_split_problems(
        splits,
        {
            "train": {"demo_prose": stream("demo_prose/00000", "demo_prose/00009")},
            "validation": {"demo_prose": stream("demo_prose/00000")},
        },
    ) == [
        "shard demo_prose/00009 (ledger split: validation) is in the train stream of demo_prose",
        "shard demo_prose/00000 (ledger split: train) is in the validation stream of demo_prose",
    ]


# ---------------------------------------------------------------- every MLflow point


def chain_of_two_parts(ledger: Ledger) -> list[dict]:
    """Run 'h': part h.p0 steps 1..2 and h.p1 steps 3..4, 1,024 real (and loss) tokens each."""
    write(ledger, part("h.p0", "h", steps=(1, 2), real=2 * TPS, loss=2 * TPS, created_at=1.0), [])
    write(ledger, part("h.p1", "h", steps=(3, 4), prev="h.p0", real=2 * TPS, loss=2 * TPS, created_at=2.0), [])
    return ledger.chain("h")


def history(real: list[int]) -> dict[str, list[tuple[int, float]]]:
    """MLflow points at steps 1.. of tokens/real (= tokens/loss), no padding or cropping."""
    points = lambda values: [(step, float(v)) for step, v in enumerate(values, start=1)]  # noqa: E731
    return {
        "tokens/real": points(real),
        "tokens/loss": points(real),
        "tokens/pad": points([0] * len(real)),
        "tokens/cropped": points([0] * len(real)),
    }


def test_a_right_token_history_passes(ledger):
    outcome = inv.mlflow_token_history(chain_of_two_parts(ledger), TPS, history([512, 1024, 1536, 2048]))
    assert outcome.passed, outcome.failures
    assert outcome.figures["logged_steps"] == 4 and outcome.figures["committed_steps"] == 2


def test_a_history_whose_last_point_is_right_fails_at_each_wrong_step(ledger):
    outcome = inv.mlflow_token_history(chain_of_two_parts(ledger), TPS, history([512, 512, 512, 2048]))
    assert not outcome.passed
    assert outcome.failures == [
        "step 2: real + pad mlflow 512 != step x tokens_per_step 1,024",
        "step 3: real + pad mlflow 512 != step x tokens_per_step 1,536",
        "step 2 (end of part h.p0, segment 0): real_tokens mlflow 512 != ledger 1,024",
        "step 2 (end of part h.p0, segment 0): loss_tokens mlflow 512 != ledger 1,024",
    ]
    # the newest point alone agrees: what the check before this one compared
    assert history([512, 512, 512, 2048])["tokens/real"][-1] == (4, 2048.0)


def test_a_falling_point_a_second_value_and_a_missing_figure_are_named(ledger):
    chain = chain_of_two_parts(ledger)
    falling = history([512, 1024, 1536, 2048])
    falling["tokens/cropped"][2] = (3, 5.0)
    assert (
        "step 4: cropped_tokens mlflow 0 falls below 5 at step 3"
        in inv.mlflow_token_history(chain, TPS, falling).failures
    )
    twice = history([512, 1024, 1536, 2048])
    twice["tokens/real"].append((2, 1000.0))
    assert (
        "step 2: real_tokens has 2 values in MLflow (1000, 1024)"
        in inv.mlflow_token_history(chain, TPS, twice).failures
    )
    missing = history([512, 1024, 1536, 2048])
    missing["tokens/pad"] = [p for p in missing["tokens/pad"] if p[0] != 4]
    assert inv.mlflow_token_history(chain, TPS, missing).failures == [
        "step 4: pad_tokens has 0 values in MLflow (none)",
        "step 4 (end of part h.p1, segment 0): pad_tokens mlflow not logged != ledger 0",
    ]


# ---------------------------------------------------------------- messages name parts, segments, steps


def test_a_resume_from_a_checkpoint_too_early_names_the_parts_segments_and_steps(tmp_path):
    """Segment 0 committed steps 1..2 and 3..4; its step-4 checkpoint was lost, so segment 1 resumed from
    step 2's and read steps 3..4 again: tokens 512..1024 of the shard twice."""
    ledger = Ledger(tmp_path / "ledger")
    write(
        ledger,
        part("r.s000.p000000002", "r", steps=(1, 2), created_at=1.0),
        [piece("demo_prose/00000", (0, 512), (0, 5))],
    )
    write(
        ledger,
        part("r.s000.p000000004", "r", steps=(3, 4), prev="r.s000.p000000002", created_at=2.0),
        [piece("demo_prose/00000", (512, 1024), (5, 9))],
    )
    write(
        ledger,
        part("r.s001.p000000004", "r", segment=1, steps=(3, 4), prev="r.s000.p000000002", created_at=3.0),
        [piece("demo_prose/00000", (512, 1024), (5, 9))],
    )
    outcome = inv.no_reuse(ledger, "r")
    assert not outcome.passed and outcome.figures["reused_tokens"] == 512
    assert outcome.failures == [
        "reuse demo_prose/00000 tokens 512..1024: read by part r.s000.p000000004 "
        "(segment 0, steps 3..4) and part r.s001.p000000004 (segment 1, steps 3..4)"
    ]
    # a range the plan's check finds read twice names the same parts (only segment 1's is on the chain)
    run = inv.StageRun(
        spec=None,
        record=None,
        chain=ledger.chain("r"),
        parts=ledger.parts(["r"]),
        consumption=ledger.consumption(ledger.parts(["r"])),
    )
    assert inv.range_readers(run, "demo_prose/00000", 0, "600..700") == (
        "read by part r.s000.p000000004 (segment 0, steps 3..4) and part r.s001.p000000004 (segment 1, steps 3..4)"
    )
    assert inv.range_readers(run, "demo_prose/00000", 0, "2000..2100") == "read by no part of the run's chain"


def test_a_cross_stage_reuse_names_the_runs_too(tmp_path):
    ledger = Ledger(tmp_path / "ledger")
    write(ledger, part("pre.p0", "pre", steps=(1, 10), created_at=1.0), [piece("s0", (0, 100), (0, 10))])
    write(
        ledger,
        part("cpt.p0", "cpt", parent="pre", stage="continued_pretrain", steps=(1, 4), created_at=2.0),
        [piece("s0", (50, 150), (5, 15))],
    )
    assert inv.no_reuse(ledger, "cpt").failures == [
        "undeclared_cross_stage s0 tokens 50..100: read by part cpt.p0 (run cpt, segment 0, steps 1..4) and "
        "part pre.p0 (run pre, segment 0, steps 1..10)",
        "50 tokens of source(s) prose were read by an earlier stage of this lineage and again by this one: expected "
        "when this stage replays them on purpose (a replay mix, or one source declared for two stages); declare it "
        "with --set 'data.replay_sources=[\"prose\"]' (the run config's data.replay_sources, keeping any source "
        "already declared there), else give this stage data its lineage has not read",
    ]


# ---------------------------------------------------------------- with the real trainer and launcher


@pytest.fixture(scope="module")
def smoke_run(demo_home, module_tmp) -> tuple[Path, str]:
    """(home, run key) of one clean 4-step smoke pretrain in a copy of the demo home."""
    from tests.conftest import copy_home
    from tests.test_audit import clean_run

    home = module_tmp("sources") / "home"
    copy_home(demo_home, home)
    return home, clean_run(home, 31)


@pytest.mark.e2e
def test_the_trainer_logs_the_token_figures_at_every_checkpoint_step(smoke_run):
    from tests.test_audit import checks_of

    home, run_key = smoke_run
    checks = checks_of(home, run_key)
    mine = (
        "mlflow_token_history",
        "ledger_mlflow_metadata_agree",
        "consumption_matches_plan",
        "no_reuse",
        "no_validation_selected",
        "no_validation_leakage",
    )
    assert all(checks[n]["passed"] for n in mine), {n: checks[n]["failures"] for n in mine}
    history = checks["mlflow_token_history"]
    # step 2 is neither a log step (every 5) nor the first or last: logged because a part ends there
    assert [
        (row[0], row[4], row[5]) for row in history["tables"]["committed_steps"]["rows"] if row[3] == "real_tokens"
    ] == [(2, str(2 * TPS), 2 * TPS), (4, str(4 * TPS), 4 * TPS)]
    assert history["figures"]["logged_steps"] == 3  # steps 1 (first), 2 (checkpoint), 4 (last)


@pytest.mark.e2e
def test_a_planted_mlflow_history_fails_at_its_wrong_steps(smoke_run):
    """The 512, 512, 512, 2048 chart logged to a real MLflow run and read back as the check reads it."""
    from mlflow.tracking import MlflowClient

    from ghostvis_core.counts import MLFLOW_METRICS
    from ghostvis_core.home import Home
    from ghostvis_core.run.track.mlflow_records import metric_histories

    home, run_key = smoke_run
    uri = Home(home).mlflow_tracking_uri
    client = MlflowClient(uri)
    planted = client.create_run(client.get_experiment_by_name("ghostvis").experiment_id).info.run_id
    for step, real in enumerate([512, 512, 512, 2048], start=1):
        client.log_metric(planted, "tokens/real", real, step=step)
        client.log_metric(planted, "tokens/loss", real, step=step)
        client.log_metric(planted, "tokens/pad", 0, step=step)
        client.log_metric(planted, "tokens/cropped", 0, step=step)
    chain = Ledger.in_store(Home(home).store).chain(run_key)
    outcome = inv.mlflow_token_history(chain, TPS, metric_histories(uri, planted, tuple(MLFLOW_METRICS.values())))
    assert not outcome.passed
    assert (
        f"step 2 (end of part {chain[0].part_id}, segment 0): real_tokens mlflow 512 != ledger 1,024"
        in outcome.failures
    )
    assert "step 3: real + pad mlflow 512 != step x tokens_per_step 1,536" in outcome.failures


@pytest.mark.e2e
def test_validation_shards_merged_into_a_train_stream_are_refused_before_launch(smoke_run, monkeypatch):
    from ghostvis_core.home import Home
    from ghostvis_core.launch.start import prepare_run
    from ghostvis_core.run.preflight import check_run
    from tests.planted import plant

    home, _ = smoke_run
    h = Home(home)
    validation = sorted(
        r.shard_id for r in Ledger.in_store(h.store).shards(sources=["demo_prose"]) if r.split == "validation"
    )
    plant("validation_merged_into_train", setter=monkeypatch.setattr)
    with pytest.raises(GhostvisError) as refused:
        check_run(prepare_run("pretrain", preset="smoke", home=h, overrides={"data.seed": 32}), h.store)  # the job's
    message = str(refused.value)
    assert f"shard {validation[0]} (ledger split: validation) is in the train stream of demo_prose" in message
    assert "fix the objective's streams" in message

"""The accounting verified against the data (issue 16): the stage checks recount the token figures
from the token files, compare the consumption with what the plan says the run had to read, check the
selection and every rank's share; `ghostvis audit` re-runs them from the store and MLflow alone.

Each planted bug (tests/planted.py: a one-line mutation of the real code in the rank processes, never
an edited file) runs on one tiny smoke pretrain with grad accumulation (4 steps of 2 x 64 x 2 ranks x
2 micro-batches = 512 tokens per step), all in one copy of the demo home; the checks are then called
directly, as the Dagster checks and the audit call them.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ghostvis_core.data.catalog import recorded_sha256
from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.shard_ref import ShardRef
from ghostvis_core.data.token_shard import TokenShard, write_token_shard
from ghostvis_core.errors import GhostvisError
from ghostvis_core.home import Home
from ghostvis_core.launch.start import prepare_run
from ghostvis_core.plan.stages import stage, stage_names
from ghostvis_core.runs.lookup import completed_runs
from ghostvis_core.verify.audit.data_checks import DATA_CHECKS
from ghostvis_core.verify.audit.stage_checks import STAGE_CHECKS
from ghostvis_core.verify.replay.refusal import REPLAYABLE_OBJECTIVES
from tests.conftest import copy_home, run_cli, run_names
from tests.planted import plant
from tests.test_errors import MATERIALIZE

pytestmark = pytest.mark.e2e

STEPS, TOKENS_PER_STEP = 4, 2 * 64 * 2 * 2
SMOKE_ACCUM = [
    "pretrain",
    "--preset",
    "smoke",
    "--set",
    f"budget.steps={STEPS}",
    "--set",
    "batch.grad_accum_steps=2",
    "--set",
    "batch.micro_batch_size=2",
    "--set",
    "batch.seq_len=64",
    "--set",
    "checkpoint.every_steps=2",
    "--set",
    "eval.val_tokens=256",
]
TORCHRUN_BUGS = [
    "rank0_counters",
    "rank0_everywhere",
    "last_micro_batch_only",
    "micro_batch_0_twice",
    "last_part_unpublished",
    "row_fed_in_place_of_another",
    "ranks_swapped",
    "targets_are_inputs",
    "mlflow_history_stale",
]
# sft: 4 steps of the smoke recipe (8 packed chats of 256 positions per rank and step, image chats among them)
SMOKE_SFT = [
    "sft",
    "--preset",
    "smoke",
    "--set",
    "budget.steps=4",
    "--set",
    "batch.micro_batch_size=8",
    "--set",
    "checkpoint.every_steps=2",
]
SFT_BUGS = ["chat_mask_ignored", "chat_doc_ids_dropped", "images_rotated"]


Scenario = tuple[str, str | None, int, list[str]]  # (name, bugs, data.seed, `ghostvis prepare` args)


def launch(home: Path, scenarios: list[Scenario], check: bool = True) -> dict[str, str]:
    """Smoke stage runs (2 ranks) one after another in one torchrun launch (tests/planted.py), each with
    its bugs planted in the rank processes for its own run only; name -> run key. A distinct data.seed
    gives each scenario a run key of its own."""
    spec = home.parent / f"scenarios-{scenarios[0][0]}.json"
    spec.write_text(
        json.dumps(
            [
                {"name": name, "bugs": bugs, "args": [*args, "--set", f"data.seed={seed}"]}
                for name, bugs, seed, args in scenarios
            ]
        )
    )
    proc = run_cli(
        ["torchrun", "--standalone", "--nproc_per_node=2", "-m", "tests.planted", str(spec)],
        home,
        check=check,
        OMP_NUM_THREADS="1",
    )
    outputs = re.split(r"^scenario (\S+)$", proc.stdout, flags=re.MULTILINE)[1:]
    keys = {name: re.search(r"run (\S+) segment", out).group(1) for name, out in zip(outputs[::2], outputs[1::2])}
    assert list(keys) == [name for name, *_ in scenarios], proc.stdout[-4000:]
    return keys


def clean_run(home: Path, seed: int) -> str:
    """One clean smoke pretrain (SMOKE_ACCUM, `data.seed=seed`) in `home`; its run key."""
    return launch(home, [("clean", None, seed, SMOKE_ACCUM)])["clean"]


@pytest.fixture(scope="module")
def planted(demo_home, module_tmp) -> tuple[Path, dict[str, str]]:
    """(home, scenario -> run key): a clean run, one run per planted bug, and a run stopped after its
    first checkpoint then resumed with the rewind bug; all in one copy of the demo home, in three launches
    (the stop ends its rank processes)."""
    home = module_tmp("planted") / "home"
    copy_home(demo_home, home)
    keys = launch(
        home,
        [("clean", None, 1, SMOKE_ACCUM)]
        + [(bug, bug, seed, SMOKE_ACCUM) for seed, bug in enumerate(TORCHRUN_BUGS, start=2)],
    )
    launch(home, [("stopped", "stop_after_first_checkpoint", 20, SMOKE_ACCUM)], check=False)
    keys |= launch(
        home,
        [("resume_rewinds", "resume_rewinds", 20, SMOKE_ACCUM), ("sft_clean", None, 30, SMOKE_SFT)]
        + [(bug, bug, seed, SMOKE_SFT) for seed, bug in enumerate(SFT_BUGS, start=31)],
    )
    return home, keys


def checks_of(
    home: Path, run_key: str, bug: str | None = None, monkeypatch=None, stage: str = "pretrain"
) -> dict[str, dict]:
    """Every stage check of the run, by name, as `ghostvis audit` runs them (no Dagster metadata). With
    `bug`, the same bug is planted in this (the auditing) process too: the audit must not run the code
    it checks, so a bug in shared code must still be caught."""
    from ghostvis_core.verify.audit.audit_report import audit_stage

    if bug:
        plant(bug, setter=monkeypatch.setattr)
    h = Home(home)
    result = audit_stage(h, Ledger.in_store(h.store), stage, run_key, None)
    return {c["name"]: c for c in result["checks"]}


def failed(checks: dict[str, dict]) -> set[str]:
    return {name for name, c in checks.items() if not c["passed"]}


def recounted(checks: dict[str, dict], *more: str) -> tuple[int, ...]:
    """The recount check's real tokens as the trainer counted them and as the token files hold them,
    then its figures named in `more`."""
    figures = checks["tokens_recounted_from_files"]["figures"]
    return tuple(figures[name] for name in ("real_tokens_trainer", "real_tokens_recount", *more))


def test_a_grad_accum_smoke_stage_passes_every_check_and_the_recount_equals_the_trainer(planted):
    home, keys = planted
    checks = checks_of(home, keys["clean"])
    assert not failed(checks), {n: c["failures"] for n, c in checks.items() if not c["passed"]}
    assert recounted(checks) == (STEPS * TOKENS_PER_STEP, STEPS * TOKENS_PER_STEP)
    assert checks["consumption_matches_plan"]["figures"]["expected_shard_tokens"] == STEPS * TOKENS_PER_STEP
    assert checks["every_rank_read_its_rows"]["figures"]["shares"] == 2 * 2  # 2 parts x 2 ranks
    content = checks["fed_content_matches_files"]["figures"]
    # 4 steps x 2 ranks, 8 rows per step rebuilt from the files, each matching its digest
    assert (content["rank_steps_checked"], content["rows_rebuilt"], content["problems"]) == (STEPS * 2, STEPS * 8, 0)


def test_a_row_recorded_but_never_trained_is_named_by_the_content_proof_alone(planted, monkeypatch):
    home, keys = planted
    checks = checks_of(home, keys["row_fed_in_place_of_another"], "row_fed_in_place_of_another", monkeypatch)
    assert failed(checks) == {"fed_content_matches_files"}  # every count, range and share is right
    failures = checks["fed_content_matches_files"]["failures"]
    # rows 2 mod 4 are rows 2 and 6 of step 1 (8 rows a step): rank 1, micro-batches 0 and 1, in every step
    assert len(failures) == STEPS * 2
    assert re.fullmatch(
        r"pretrain step 1 rank 1 micro-batch 0: row 2 was recorded but row 3 was fed in its place "
        r"\(first differing position \d+: inputs \d+ in the files' row 2, \d+ fed\)",
        failures[0],
    ), failures[0]


def test_a_rank_offset_bug_in_shared_row_arithmetic_is_caught_with_the_bug_in_the_audit_too(planted, monkeypatch):
    home, keys = planted
    checks = checks_of(home, keys["ranks_swapped"], "ranks_swapped", monkeypatch)
    assert {"every_rank_read_its_rows", "fed_content_matches_files"} <= failed(checks)
    assert {"tokens_recounted_from_files", "consumption_matches_plan"}.isdisjoint(failed(checks))  # totals right
    problems = checks["every_rank_read_its_rows"]["tables"]["problems"]["rows"]
    assert [(row[1], row[2], row[3]) for row in problems[:2]] == [
        (0, "0..2, 4..6, 8..10, 12..14", "2..4, 6..8, 10..12, 14..16"),
        (1, "2..4, 6..8, 10..12, 14..16", "0..2, 4..6, 8..10, 12..14"),
    ]
    assert (
        "pretrain step 1 rank 0 micro-batch 0: recorded rows 2..4, the plan's rows are 0..2"
        in checks["fed_content_matches_files"]["failures"]
    )


def test_counters_summed_on_rank_0_only_fail_the_recount(planted):
    home, keys = planted
    checks = checks_of(home, keys["rank0_counters"])
    assert {"tokens_recounted_from_files", "ledger_mlflow_metadata_agree"} <= failed(checks)
    assert recounted(checks) == (STEPS * TOKENS_PER_STEP // 2, STEPS * TOKENS_PER_STEP)


@pytest.mark.parametrize(
    ("scenario", "rank_problems"),
    [
        pytest.param("rank0_everywhere", {(1, "no share recorded")}, id="rank_0_only_everywhere"),
        pytest.param("last_micro_batch_only", {(0, "other rows"), (1, "other rows")}, id="only_the_last_micro_batch"),
    ],
)
def test_rows_counted_on_too_few_ranks_or_micro_batches_leave_a_gap_and_the_ranks_problems(
    planted, scenario, rank_problems
):
    home, keys = planted
    checks = checks_of(home, keys[scenario])
    assert {"consumption_matches_plan", "every_rank_read_its_rows"} <= failed(checks)
    assert checks["consumption_matches_plan"]["figures"]["gap_tokens"] == STEPS * TOKENS_PER_STEP // 2
    problems = checks["every_rank_read_its_rows"]["tables"]["problems"]["rows"]
    assert {(row[1], row[4]) for row in problems} == rank_problems


def test_targets_equal_to_the_inputs_are_caught_by_the_content_proof_alone(planted, monkeypatch):
    home, keys = planted
    checks = checks_of(home, keys["targets_are_inputs"], "targets_are_inputs", monkeypatch)
    assert failed(checks) == {"fed_content_matches_files"}
    failures = checks["fed_content_matches_files"]["failures"]
    assert len(failures) == STEPS * 2 * 2  # every micro-batch of every rank and step
    assert (
        failures[0]
        == "pretrain step 1 rank 0 micro-batch 0: row 0 as fed matches no row of the plan within 2 steps of step 1"
    )


def test_a_stale_mlflow_token_chart_with_a_right_last_point_is_named_step_by_step(planted, monkeypatch):
    home, keys = planted
    checks = checks_of(home, keys["mlflow_history_stale"], "mlflow_history_stale", monkeypatch)
    assert failed(checks) == {"mlflow_token_history"}  # the newest point, which the old check read, is right
    failures = checks["mlflow_token_history"]["failures"]
    assert "step 2: real + pad mlflow 512 != step x tokens_per_step 1,024" in failures


def sft_checks(planted, bug: str | None, monkeypatch) -> dict[str, dict]:
    home, keys = planted
    return checks_of(home, keys[bug or "sft_clean"], bug, monkeypatch, stage="sft")


def test_a_clean_sft_run_with_images_passes_every_check_and_its_rows_are_rebuilt(planted, monkeypatch):
    checks = sft_checks(planted, None, monkeypatch)
    assert not failed(checks), {n: c["failures"] for n, c in checks.items() if not c["passed"]}
    content = checks["fed_content_matches_files"]["figures"]
    assert (content["rank_steps_checked"], content["rows_rebuilt"], content["problems"]) == (4 * 2, 4 * 16, 0)


def test_loss_on_every_chat_token_fails_the_recount_and_the_content_proof(planted, monkeypatch):
    checks = sft_checks(planted, "chat_mask_ignored", monkeypatch)
    assert {"tokens_recounted_from_files", "fed_content_matches_files"} <= failed(checks)
    figures = checks["tokens_recounted_from_files"]["figures"]
    assert figures["loss_tokens_trainer"] > figures["loss_tokens_recount"] > 0
    assert figures["real_tokens_trainer"] == figures["real_tokens_recount"]


def test_packed_chats_attending_across_documents_are_caught_by_the_content_proof_alone(planted, monkeypatch):
    checks = sft_checks(planted, "chat_doc_ids_dropped", monkeypatch)
    assert failed(checks) == {"fed_content_matches_files"}
    assert (
        "sft step 1 rank 0 micro-batch 0: row 0 as fed matches no row of the plan"
        in checks["fed_content_matches_files"]["failures"][0]
    )


def test_images_fed_to_the_wrong_rows_are_caught_by_the_content_proof_alone(planted, monkeypatch):
    checks = sft_checks(planted, "images_rotated", monkeypatch)
    assert failed(checks) == {"fed_content_matches_files"}
    assert all(": images fed [" in f for f in checks["fed_content_matches_files"]["failures"])


def test_micro_batch_0_trained_twice_fails_the_recount_where_the_old_checks_passed(planted, monkeypatch):
    home, keys = planted
    checks = checks_of(home, keys["micro_batch_0_twice"], "micro_batch_0_twice", monkeypatch)
    assert {
        "tokens_recounted_from_files",
        "consumption_matches_plan",
        "every_rank_read_its_rows",
        "fed_content_matches_files",
    } <= failed(checks)
    assert {"tokens_match_plan", "ledger_mlflow_metadata_agree"}.isdisjoint(failed(checks))  # the old checks miss it
    half = STEPS * TOKENS_PER_STEP // 2
    assert recounted(checks, "overlap_tokens") == (2 * half, half, half)
    assert checks["consumption_matches_plan"]["figures"]["gap_tokens"] == half


def test_an_unpublished_last_part_fails_the_recount_and_the_expected_consumption(planted):
    home, keys = planted
    checks = checks_of(home, keys["last_part_unpublished"])
    assert {"tokens_recounted_from_files", "consumption_matches_plan"} <= failed(checks)
    assert recounted(checks) == (STEPS * TOKENS_PER_STEP, STEPS * TOKENS_PER_STEP // 2)
    assert any("the chain ends after step 2" in f for f in checks["consumption_matches_plan"]["failures"])


def test_a_resume_that_rewinds_reads_twice_and_shifts(planted):
    home, keys = planted
    checks = checks_of(home, keys["resume_rewinds"])
    assert {"no_reuse", "consumption_matches_plan", "tokens_recounted_from_files"} <= failed(checks)
    half = STEPS * TOKENS_PER_STEP // 2
    figures = checks["consumption_matches_plan"]["figures"]
    assert (figures["read_twice_tokens"], figures["gap_tokens"]) == (half, half)
    assert any("starts at step 3, row 0" in f for f in checks["consumption_matches_plan"]["failures"])


def test_a_dropped_split_filter_is_refused_before_launch_and_by_the_stage_check(planted, monkeypatch):
    from ghostvis_core.verify.audit import invariants as inv

    home, keys = planted
    h = Home(home)
    plant("split_filter_dropped", setter=monkeypatch.setattr)
    with pytest.raises(GhostvisError, match=r"\(validation\).* selected for training are not train shards"):
        prepare_run("pretrain", preset="smoke", home=h)
    monkeypatch.undo()
    ledger = Ledger.in_store(h.store)
    run = inv.StageRun.load(h.store, ledger, "pretrain", keys["clean"])
    validation = next(
        r for r in ledger.shards(tokenizer_id=run.spec.tokenizer_id, sources=["demo_prose"]) if r.split == "validation"
    )
    leaked = ShardRef(validation.shard_id, "demo_prose", "validation", "", 0, 0, validation.content_sha256)
    selected = {**run.spec.train_shards, "demo_prose": (*run.spec.train_shards["demo_prose"], leaked)}
    run.spec = replace(run.spec, train_shards=selected)
    outcome = inv.no_validation_selected(ledger, run)
    assert not outcome.passed and outcome.failures == [f"{validation.shard_id} selected for training is validation"]


@pytest.mark.parametrize("bug", [None, "last_micro_batch_only", "micro_batch_0_twice"])
def test_the_real_training_step_delivers_every_micro_batch_once(planted, monkeypatch, bug):
    """Two calls of the real train_step (world size 1, two micro-batches per step): the rows and pieces
    it hands the ledger are the plan's, and the recount from the files equals its figures; each
    planted bug makes the same comparison fail."""
    import torch

    from ghostvis_core.data.ledger.records import PartRow, ShareRow
    from ghostvis_core.data.ledger.write import pieces_to_rows, row_ranges
    from ghostvis_core.data.loader import merge_pieces
    from ghostvis_core.run.train.dist import DistContext
    from ghostvis_core.run.train.setup import setup
    from ghostvis_core.verify.audit.expected import share_problems
    from ghostvis_core.verify.audit.recount import FileRecount, recount

    home, _ = planted
    overrides = {
        "batch.world_size": 1,
        "batch.grad_accum_steps": 2,
        "batch.micro_batch_size": 2,
        "batch.seq_len": 64,
        "budget.steps": 2,
        "eval.val_tokens": 256,
        "data.seed": 40,
    }
    spec = prepare_run("pretrain", preset="smoke", overrides=overrides, home=Home(home))
    if bug:
        plant(bug, setter=monkeypatch.setattr)
    trainer = setup(spec, DistContext(0, 0, 1, torch.device("cpu")))
    trainer.train_step()  # looked up now: a planted bug replaces it
    trainer.train_step()
    assert trainer.tracker.mlflow is None  # nothing was logged, so no MLflow run was made (run/train/live_metrics.py)
    c = trainer.part.consumption
    part = PartRow("p", "", "r", "", "pretrain", 0, 1, 2, 0, 0, **c.counts.as_dict(), micro_batch_size=2, seq_len=64,
                   world_size=1, grad_accum_steps=2)  # fmt: skip
    share = ShareRow("p", "r", 0, 1, len(c.rows), row_ranges(c.rows), **c.counts.as_dict())
    merged, overlap = merge_pieces(c.pieces)
    counted, _ = recount(
        FileRecount(Home(home).store, spec, {}),
        pieces_to_rows(part, merged, trainer.objective.rows_of),
        2 * trainer.plan.tokens_per_step,
    )
    found = (share_problems(part, [share], trainer.plan.rows_per_step), overlap, counted == trainer.state.counts)
    if bug is None:
        assert found == ([], 0, True) and trainer.state.counts.real_tokens == 2 * trainer.plan.tokens_per_step
    else:
        assert found != ([], 0, True), f"{bug} went unnoticed"


# ---------------------------------------------------------------- `ghostvis audit` on the demo, and tampered


def audit_cli(home: Path, *args: str):
    return run_cli(["ghostvis", "audit", *args], home, check=False, timeout=900)


def test_audit_of_the_demo_exits_0_with_trainer_figures_next_to_the_recount(demo_home):
    proc = audit_cli(demo_home, "--json")
    report = json.loads(proc.stdout)
    assert proc.returncode == 0, report["failures"]
    assert [s["stage"] for s in report["stages"]] == stage_names()
    for s in report["stages"]:
        for figure, trainer, ledger, mlflow, metadata, recount, status in s["figures"]:
            assert trainer == ledger == mlflow == metadata == recount and status == "ok", (s["stage"], figure)
        recount = next(c for c in s["checks"] if c["name"] == "tokens_recounted_from_files")["figures"]
        wall = completed_runs(Home(demo_home).store, s["stage"])[-1].wall_time_s
        print(
            f"{s['stage']}: recount {recount['recount_seconds']:.3f} s of a {wall:.1f} s stage "
            f"({100 * recount['recount_seconds'] / wall:.2f}%)"
        )


def test_the_checks_only_job_re_executes_every_check_without_retraining(home_copy):
    from dagster import DagsterEventType, DagsterInstance

    runs_before = run_names(home_copy)
    run_cli(
        ["dagster", "job", "execute", "-m", "ghostvis_pipeline.definitions", "-j", "checks_only"],
        home_copy,
        timeout=1200,
    )
    assert run_names(home_copy) == runs_before
    with DagsterInstance.from_config(str(home_copy / "dagster")) as instance:
        run = instance.get_runs(limit=1)[0]
        events = instance.get_records_for_run(run.run_id, of_type=DagsterEventType.ASSET_CHECK_EVALUATION).records
        results = {
            (
                e.event_log_entry.dagster_event.event_specific_data.asset_key.to_user_string(),
                e.event_log_entry.dagster_event.event_specific_data.check_name,
            ): e.event_log_entry.dagster_event.event_specific_data.passed
            for e in events
        }
    assert run.job_name == "checks_only"
    assert results[("sft", "tokens_recounted_from_files")] and all(results.values()), results
    # the tokenizer's check, the ledger's data checks, the lineage quality gate on `evaluation`, then every
    # stage check of every stage and the replay_matches of every stage whose runs replay
    replayed = [s for s in stage_names() if stage(s).objective in REPLAYABLE_OBJECTIVES]
    assert results[("pretrain", "replay_matches")]
    assert len(results) == 1 + len(DATA_CHECKS) + 1 + len(STAGE_CHECKS) * len(stage_names()) + len(replayed)


def last_part_files(home: Path, stage: str) -> list[Path]:
    h = Home(home)
    run_key = completed_runs(h.store, stage)[-1].run_key
    ledger = Ledger.in_store(h.store)
    head = ledger.chain(run_key)[-1]
    return [ledger.part_file(table, head) for table in ("parts", "consumption", "shares")]


def test_a_ledger_part_duplicated_under_another_name_is_named(home_copy):
    for f in last_part_files(home_copy, "continued_pretrain"):
        shutil.copyfile(f, f.with_name("copy-" + f.name))
    proc = audit_cli(home_copy, "--stage", "continued_pretrain")
    assert proc.returncode == 1
    assert re.search(r"continued_pretrain: consumption_matches_plan: part \S+ is recorded 2 times", proc.stdout)
    assert "continued_pretrain: tokens_recounted_from_files" in proc.stdout  # its ranges are read twice


def test_a_deleted_ledger_part_is_named(home_copy):
    for f in last_part_files(home_copy, "sft"):
        f.unlink()
    proc = audit_cli(home_copy, "--stage", "sft")
    assert proc.returncode == 1
    assert re.search(
        r"sft: tokens_recounted_from_files: run \(trainer's run record\): real_tokens trainer [\d,]+ "
        r"!= recount [\d,]+",
        proc.stdout,
    )
    assert "sft: consumption_matches_plan: the chain ends after step" in proc.stdout


def test_an_edited_mlflow_token_metric_is_named(home_copy):
    from mlflow.tracking import MlflowClient

    record = completed_runs(Home(home_copy).store, "dpo")[-1]
    client = MlflowClient(Home(home_copy).mlflow_tracking_uri)
    client.log_metric(record.mlflow_run_id, "tokens/real", record.counts.real_tokens + 7, step=record.steps + 1)
    proc = audit_cli(home_copy, "--stage", "dpo")
    assert proc.returncode == 1
    assert (
        f"dpo: ledger_mlflow_metadata_agree: real_tokens: ledger {record.counts.real_tokens}, "
        f"mlflow {record.counts.real_tokens + 7}" in proc.stdout
    )


def test_a_token_shard_replaced_by_other_content_with_the_same_rows_is_named(home_copy):
    h = Home(home_copy)
    run_key = completed_runs(h.store, "pretrain")[-1].run_key
    shard_id = Ledger.in_store(h.store).consumed_by_shard(run_key)[0].shard_id
    tokenizer_id = json.loads(h.store.read_text("run_spec", "pretrain", run_key))["tokenizer_id"]
    content = recorded_sha256(h.store, shard_id)
    path = h.store.fetch("token_shard", tokenizer_id, shard_id, content)  # a folder store's own file, rewritten below
    shard = TokenShard.open(path, shard_id)
    reversed_docs = [shard.doc_tokens(d)[::-1] for d in range(shard.num_docs)]  # same rows, same lengths
    offsets = pa.array([0, *[int(x) for x in (shard.offsets[1:] - shard.offsets[0])]], pa.int64())
    tokens = pa.LargeListArray.from_arrays(
        offsets, pa.array([t for doc in reversed_docs for t in doc.tolist()], pa.from_numpy_dtype(shard.values.dtype))
    )
    write_token_shard(path, {"row": pa.array(shard.rows), "tokens": tokens})
    proc = audit_cli(home_copy, "--stage", "pretrain")
    assert proc.returncode == 1
    assert (
        f"pretrain: tokens_recounted_from_files: token file of {shard_id} is not the one the ledger recorded"
        in proc.stdout
    )
    assert f"data: ledger_matches_token_files: shard {shard_id}" in proc.stdout


def stale_inputs(status_json: str) -> dict[str, list[str]]:
    """`ghostvis status --json`: asset -> why it is stale, but for "its code changed" (other work in the tree
    while the suite runs, as tests/test_cache.py allows), for the assets with another reason."""
    out = {}
    for row in json.loads(status_json):
        reasons = [r for r in row["reasons"] if "its code changed" not in r]
        if row["state"] == "stale" and reasons:
            out[row["asset"]] = reasons
    return out


def test_a_source_file_changed_under_its_name_is_a_new_version_and_the_trained_lineage_stays_audited(
    home_copy, tmp_path
):
    """The pretrain run's first consumed shard, re-registered under its name with other content (as a
    manifest that pins the new file's sha256): raw_shards keeps both versions, status names the stale
    stages, the old run is audited against what it read before and after the new version is tokenized,
    and training waits for that tokenization."""
    from ghostvis_core.data.catalog import raw_content
    from ghostvis_core.launch.start import plan_run
    from ghostvis_core.store.files import sha256_file

    h = Home(home_copy)
    old_run = completed_runs(h.store, "pretrain")[-1].run_key
    shard_id = Ledger.in_store(h.store).consumed_by_shard(old_run)[0].shard_id
    source, name = shard_id.split("/")
    old = recorded_sha256(h.store, shard_id)
    changed = tmp_path / f"{name}.parquet"
    table = pq.read_table(h.store.fetch("raw_shard", shard_id))
    pq.write_table(table.set_column(0, "text", pa.array([t[::-1] for t in table.column("text").to_pylist()])), changed)
    new = sha256_file(changed)
    manifest = h.store.read_json("manifest", source)
    [entry] = [e for e in manifest["shards"] if e["name"] == name]
    entry.update(url=changed.as_uri(), bytes=changed.stat().st_size, sha256=new)
    h.store.write_json("manifest", source, data=manifest)

    run_cli([*MATERIALIZE, "--select", "raw_shards", "--partition", shard_id], home_copy)
    assert recorded_sha256(h.store, shard_id) == new
    assert h.store.read_json("raw_shard_meta", shard_id)["versions"][-1]["sha256"] == old
    assert sha256_file(raw_content(h.store, shard_id, old)) == old
    stale = stale_inputs(run_cli(["ghostvis", "status", "--json"], home_copy).stdout)
    assert stale["tokenized_shards"] == [f"{shard_id}: input raw_shards changed in partition(s) {shard_id}"]
    assert sorted(stale) == ["tokenized_shards", "tokenizer"]  # the assets that read the raw shard
    proc = audit_cli(home_copy, "--stage", "pretrain")
    assert proc.returncode == 0, proc.stdout[-3000:]
    with pytest.raises(GhostvisError, match=rf"^shard {shard_id} changed under its name: raw_shards recorded content"):
        plan_run("pretrain", preset="smoke", home=h)

    run_cli([*MATERIALIZE, "--select", "tokenized_shards", "--partition", shard_id], home_copy)
    run_cli([*MATERIALIZE, "--select", "token_ledger"], home_copy)
    stale = stale_inputs(run_cli(["ghostvis", "status", "--json"], home_copy).stdout)
    assert "tokenized_shards" not in stale and "token_ledger" not in stale
    assert all(stale[s][0] == stale["pretrain"][0] for s in stage_names())  # every stage reads the ledger
    assert stale["pretrain"][1:] == [
        f"run {old_run} trained on shards revised since: {shard_id} (sha256 {old} -> {new})"
    ]
    assert stale["pretrain"][0].startswith("input token_ledger changed (data version ")
    versions = [r for r in Ledger.in_store(h.store).shards(every_version=True) if r.shard_id == shard_id]
    assert [(r.content_sha256, r.replaces_sha256) for r in versions] == [(old, ""), (new, old)]
    assert all(sha256_file(Path(r.token_path)) == r.token_sha256 for r in versions)  # both kept
    proc = audit_cli(home_copy, "--stage", "pretrain", "--json")
    assert proc.returncode == 0, proc.stdout[-3000:]  # the old run reads the old version's token files
    data = {c["name"]: c["figures"] for c in json.loads(proc.stdout)["data"]}
    tokenizer_id = h.store.read_json("run_spec", "pretrain", old_run)["tokenizer_id"]
    every = Ledger.in_store(h.store).shards(tokenizer_id=tokenizer_id, every_version=True)
    assert sum(r.shard_id == shard_id for r in every) == 2
    # the token ledger's checks read every version a run may have trained, the old one included
    assert data["ledger_matches_token_files"]["ledger_tokens"] == sum(r.tokens for r in every)
    assert data["ledger_matches_token_files"]["recounted_tokens"] == sum(r.tokens for r in every)
    assert data["removed_tokens_reconcile"]["shards_checked"] == sum(r.kind == "text" for r in every)
    planned = plan_run("pretrain", preset="smoke", home=h)
    assert [r.content_sha256 for r in planned.train_shards[source] if r.shard_id == shard_id] == [new]
    assert not old_run.startswith(planned.base_key)

"""One owner per concept (issue 26): each concept the pipeline used to write out in several places has one
registry, and every user of the concept reads it. Each test checks the owner's behaviour and that the
copies it replaced have not come back."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from ghostvis_core.data.loader import LMRows, blank_row, padded_row, rank_batches, rank_share
from ghostvis_core.data.stream import SourceStream
from ghostvis_core.home import Home
from ghostvis_core.plan.batch import IGNORE_INDEX, BatchPlan
from ghostvis_core.plan.budget import batch_plan
from ghostvis_core.plan.config import BatchConfig
from ghostvis_core.plan.stages import STAGES
from ghostvis_core.runs.lookup import completed_runs, find_upstream, newest_completed_run
from ghostvis_core.runs.run_result import RunResult
from ghostvis_core.verify.audit.data_checks import DATA_CHECKS
from ghostvis_core.verify.audit.stage_checks import STAGE_CHECKS
from ghostvis_core.verify.replay.check import NAME as REPLAY_CHECK
from ghostvis_core.verify.replay.refusal import REPLAYABLE_OBJECTIVES
from tests.test_loader import write_shard

ROOT = Path(__file__).resolve().parents[1]
CODE = [p for d in ("ghostvis_core", "ghostvis_pipeline", "benchmarks") for p in sorted((ROOT / d).rglob("*.py"))]


def files_matching(pattern: str) -> list[str]:
    """The project's source files (not tests) in which `pattern` occurs."""
    return [str(p.relative_to(ROOT)) for p in CODE if re.search(pattern, p.read_text(encoding="utf-8"))]


# ---------------------------------------------------------------- stage and data checks


def test_dagster_checks_and_the_checks_only_job_are_the_one_check_tables():
    from ghostvis_pipeline.definitions import defs
    from ghostvis_pipeline.launchpad.asset_jobs import checks_job

    graph = defs.resolve_asset_graph()
    by_asset: dict[str, list] = {}
    for key in graph.asset_check_keys:
        by_asset.setdefault(key.asset_key.to_user_string(), []).append(key)
    ledger_checks = {k.name: graph.get_check_spec(k).description for k in by_asset["token_ledger"]}
    assert ledger_checks == {name: description for name, description, _ in DATA_CHECKS}
    for stage in STAGES:
        stage_checks = {k.name: graph.get_check_spec(k).description for k in by_asset[stage.name]}
        # besides the table: the non-blocking replay, on the stages whose runs replay
        replay = stage_checks.pop(REPLAY_CHECK, None)
        assert (replay is not None) == (stage.objective in REPLAYABLE_OBJECTIVES), stage.name
        assert stage_checks == {name: description for name, description, _ in STAGE_CHECKS}, stage.name
    assert checks_job.selection.resolve_checks(graph) == set(graph.asset_check_keys)
    # the data checks are built from the table, not written out by name a second time
    assert files_matching(r"def (ledger_matches_token_files|removed_tokens_reconcile)\(context") == []


def test_the_audit_runs_the_data_check_table_in_order(demo_home):
    from ghostvis_core.data.ledger import Ledger
    from ghostvis_core.verify.audit.audit_report import data_checks

    home = Home(demo_home)
    outcomes = data_checks(home, Ledger.in_store(home.store))
    assert [o.name for o in outcomes] == [name for name, _, _ in DATA_CHECKS]
    assert all(o.passed for o in outcomes), [o.failures for o in outcomes]


# ---------------------------------------------------------------- the newest completed run


def test_every_reader_of_a_stage_means_its_newest_completed_run(demo_home):
    from ghostvis_core.data.ledger import Ledger
    from ghostvis_core.verify.audit.audit_report import newest_run_key
    from ghostvis_pipeline.cli import resolve_run

    home = Home(demo_home)
    ledger = Ledger.in_store(home.store)
    for stage in STAGES:
        runs = completed_runs(home.store, stage.name)
        newest = newest_completed_run(home.store, stage.name)
        assert runs and newest == runs[-1] and "@" not in newest.run_key
        assert find_upstream(home.store, stage.name).run_key == newest.run_key
        assert newest_run_key(home, stage.name, None) == newest.run_key
        assert resolve_run(home, ledger, stage.name) == newest.run_key
    assert newest_completed_run(home.store, "no_such_stage") is None
    # `runs[-1]` of completed_runs is written once, in runs/lookup.py
    assert files_matching(r"completed_runs\([^)]*\)\[-1\]|runs\[-1\]\.") == []


# ---------------------------------------------------------------- the Dagster metadata reader


def test_latest_materialization_metadata_is_read_in_one_place():
    assert files_matching(r"get_latest_materialization_event") == ["ghostvis_pipeline/metadata.py"]


# ---------------------------------------------------------------- the rank-split evaluation loop


@pytest.fixture
def windows(tmp_path) -> LMRows:
    """23 rows of 4 tokens: token 100 + p at stream position p."""
    return LMRows(SourceStream("prose", [write_shard(tmp_path, "prose", "p-000", [list(range(100, 193))])], seed=1), 4)


def test_rank_batches_cover_each_row_once_over_the_ranks(windows):
    for world in (1, 2, 3):
        rows = [g for rank in range(world) for b in rank_batches(windows, 23, rank, world, 4) for g in b.rows]
        assert sorted(rows) == list(range(23)), world
        assert all(len(b.rows) <= 4 for b in rank_batches(windows, 23, 1, world, 4))
    first = next(rank_batches(windows, 23, 1, 2, 2))
    assert first.rows == [1, 3] and first.inputs[0].tolist() == [104, 105, 106, 107]
    assert list(rank_share(7, 2, 3)) == [2, 5]


def test_rank_batches_keep_pairs_together_and_leave_out_a_short_last_batch(windows):
    pairs = [b.rows for b in rank_batches(windows, 11, 1, 2, 4, group=2)]  # 5 pairs; rank 1 has pairs 1 and 3
    assert pairs == [[2, 3, 6, 7]]
    assert [b.rows for b in rank_batches(windows, 5, 0, 1, 2, min_rows=2)] == [[0, 1], [2, 3]]  # row 4 alone: left out
    assert files_matching(r"range\(ctx\.rank|range\(rank, ") == ["ghostvis_core/data/loader.py"]


# ---------------------------------------------------------------- row padding


def test_padded_row_cuts_pads_and_counts():
    row = padded_row(np.arange(10, 16), 3, 8, 0, [])  # 3 prompt tokens, 3 response tokens, 2 pad
    assert row.inputs.tolist() == [10, 11, 12, 13, 14, 15, 0, 0]
    assert row.targets.tolist() == [IGNORE_INDEX, IGNORE_INDEX, 13, 14, 15, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]
    assert (row.real, row.pad, row.cropped, row.loss) == (6, 2, 0, 3)
    cut = padded_row(np.arange(10, 22), 3, 8, 0, [])
    assert (cut.real, cut.pad, cut.cropped, cut.loss) == (8, 0, 4, 5)
    inputs, targets = blank_row(3, 7)
    assert inputs.tolist() == [7, 7, 7] and targets.tolist() == [IGNORE_INDEX] * 3
    # one rule for the rows' arrays: no row class allocates its own padded inputs
    loader = (ROOT / "ghostvis_core" / "data" / "loader.py").read_text(encoding="utf-8")
    assert loader.count("pad_id, dtype=np.int64)") == 1


# ---------------------------------------------------------------- batch factors


def test_one_batch_factor_type_from_planner_to_run_record_and_audit():
    plan = batch_plan(BatchConfig(4, 128, world_size=2, total_batch_tokens=4096))
    assert plan == BatchPlan(4, 128, 2, 4) and (plan.tokens_per_step, plan.rows_per_step) == (4096, 32)
    spec_plan = {
        "micro_batch_size": 4,
        "seq_len": 128,
        "world_size": 2,
        "grad_accum_steps": 4,
        "tokens_per_step": 4096,
        "steps": 3,
    }
    assert BatchPlan.of(spec_plan) == plan and plan.to_dict() == {k: v for k, v in spec_plan.items() if k != "steps"}
    assert RunResult.__dataclass_fields__["batch"].type == "BatchPlan"
    assert files_matching(r"class (BatchPlan|BatchShape)\b") == ["ghostvis_core/plan/batch.py"]
    assert files_matching(r"\(\"micro_batch_size\", \"world_size\", \"grad_accum_steps\"\)") == []

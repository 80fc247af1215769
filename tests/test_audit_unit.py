"""Unit tests of the audit's pieces: range arithmetic, each rank's expected rows, and the real shard
selection refusing a validation shard (with the split filter planted away), on no training run; and
every check's figures showing both sides of its comparisons, on the demo's clean runs."""

from __future__ import annotations

import pytest

from ghostvis_core.counts import ROLLOUT_FIGURES, TokenCounts
from ghostvis_core.data.bpe_tokenizer import newest_tokenizer
from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.ledger.records import PartRow, ShardRecord, ShareRow
from ghostvis_core.data.ledger.write import row_ranges
from ghostvis_core.errors import GhostvisError
from ghostvis_core.home import Home
from ghostvis_core.launch.start import select_shards
from ghostvis_core.plan.stages import stage_names
from ghostvis_core.runs.lookup import completed_runs
from ghostvis_core.store import FolderStore
from ghostvis_core.verify.audit import invariants as inv
from ghostvis_core.verify.audit.check_outcome import covered_twice, subtract, union
from ghostvis_core.verify.audit.expected import rank_rows, share_problems
from ghostvis_core.verify.audit.stage_checks import STAGE_CHECKS, CheckInputs
from tests.planted import plant
from tests.test_loader import write_shard


def test_range_arithmetic():
    assert union([(5, 9), (0, 3), (3, 4), (8, 12)]) == [(0, 4), (5, 12)]
    assert subtract([(0, 10)], [(2, 3), (5, 7)]) == [(0, 2), (3, 5), (7, 10)]
    assert covered_twice([(0, 4), (4, 8)]) == []  # touching is not overlapping
    assert covered_twice([(0, 6), (4, 8), (5, 9)]) == [(4, 8)]


def part(step_first=1, step_last=2, world_size=2, **figures) -> PartRow:
    return PartRow(
        "r.s000.p000000002", "", "r", "", "pretrain", 0, step_first, step_last, 0, 0,
        micro_batch_size=2, seq_len=8, world_size=world_size, grad_accum_steps=2, **figures,
    )  # fmt: skip


def test_each_rank_reads_its_interleaved_micro_batches():
    # 8 rows per step: micro-step m on rank r reads rows (2m + r) x 2 + [0, 2)
    assert rank_rows(part(), 0, 8) == [[0, 2], [4, 6], [8, 10], [12, 14]]
    assert rank_rows(part(), 1, 8) == [[2, 4], [6, 8], [10, 12], [14, 16]]


def share(rank: int, rows: list[int], real: int) -> ShareRow:
    return ShareRow("r.s000.p000000002", "r", rank, 2, len(rows), row_ranges(rows), real, 0, real, 0)


def test_a_missing_or_wrong_rank_share_is_named():
    p = part(real_tokens=128, loss_tokens=128)
    rank0 = [0, 1, 4, 5, 8, 9, 12, 13]
    rank1 = [2, 3, 6, 7, 10, 11, 14, 15]
    assert share_problems(p, [share(0, rank0, 64), share(1, rank1, 64)], 8) == []
    assert [r[1:] for r in share_problems(p, [share(0, rank0, 128)], 8)] == [
        [1, "2..4, 6..8, 10..12, 14..16", "none", "no share recorded"]
    ]
    twice = [0, 1, 0, 1, 8, 9, 8, 9]  # micro-batch 0 read twice, micro-batch 1 never
    problems = share_problems(p, [share(0, twice, 64), share(1, rank1, 32)], 8)
    assert [r[1] for r in problems] == [0, "all"] and problems[0][4] == "other rows"


def test_the_real_shard_selection_refuses_a_validation_shard(tmp_path, monkeypatch):
    store = FolderStore(tmp_path / "store")
    ledger = Ledger.in_store(store)
    for shard_id, split in (("prose/train-000", "train"), ("prose/val-000", "validation")):
        content = f"content-of-{split}"  # the token file is the version of this raw content
        token_file = store.writable("token_shard", "tok", shard_id, content)
        ref = write_shard(token_file.parent.parent, token_file.parent.name, content, [[1, 2, 3], [4, 5]], split=split)
        store.publish("token_shard", "tok", shard_id, content)
        ledger.write_shard(
            ShardRecord(
                shard_id=shard_id,
                source="prose",
                split=split,
                kind="text",
                content_sha256=content,
                raw_bytes=1,
                tokenizer_id="tok",
                docs=ref.docs,
                tokens=ref.tokens,
                text_bytes=1,
                token_path=ref.path,
            )
        )
    selected = select_shards(ledger, store, "tok", ["prose"], "train")
    assert [r.shard_id for r in selected["prose"]] == ["prose/train-000"]
    plant("split_filter_dropped", setter=monkeypatch.setattr)
    with pytest.raises(GhostvisError, match=r"prose/val-000 \(validation\) selected for training are not train"):
        select_shards(ledger, store, "tok", ["prose"], "train")


# Each stage check's comparisons as pairs of figures (Dagster metadata entries): (one side, the other).
CHECK_SIDES = {
    "tokens_recounted_from_files": [(f"{k}_trainer", f"{k}_recount") for k in TokenCounts.names()],
    "fed_content_matches_files": [("rows_rebuilt", "rows_fed")],
    "rollouts_recounted": [(f"{k}_recount", f"{k}_ledger") for k in ROLLOUT_FIGURES]
    + [("prompt_tokens_recount", "prompt_tokens_ledger")],
    "consumption_matches_plan": [
        ("expected_shard_tokens", "consumed_shard_tokens"),
        ("rows_planned", "rows_recorded"),
        ("steps_planned", "steps_trained"),
        ("steps_x_tokens_per_step", "consumed_positions"),
    ],
    "every_rank_read_its_rows": [("rows_expected", "rows_recorded")],
}


def test_every_check_shows_both_sides_of_its_comparisons_equal_on_the_clean_demo(demo_home):
    home = Home(demo_home)
    ledger = Ledger.in_store(home.store)
    checks = {name: check for name, _, check in STAGE_CHECKS if name in CHECK_SIDES}
    assert set(checks) == set(CHECK_SIDES)
    figures = {}  # (stage, check) -> the check's figures
    for stage in stage_names():
        inputs = CheckInputs(
            home, ledger, inv.StageRun.load(home.store, ledger, stage, completed_runs(home.store, stage)[-1].run_key)
        )
        figures.update({(stage, name): check(inputs).figures for name, check in checks.items()})
    shown = {
        (stage, name): {k: f.get(k) for pair in CHECK_SIDES[name] for k in pair}
        for (stage, name), f in figures.items()
        if any(k in f for pair in CHECK_SIDES[name] for k in pair)
    }
    for (stage, name), sides in shown.items():
        for a, b in CHECK_SIDES[name]:
            assert sides[a] == sides[b] is not None, (stage, name, a, b, figures[stage, name])
    assert {name for _, name in shown} == set(CHECK_SIDES)  # rollouts_recounted: the rl stage only
    assert shown["rl", "rollouts_recounted"]["prompt_tokens_ledger"] > 0
    assert (
        shown["pretrain", "fed_content_matches_files"]["rows_fed"]
        == shown["pretrain", "every_rank_read_its_rows"]["rows_recorded"]
        > 0
    )
    data = inv.ledger_matches_token_files(home.store, ledger, newest_tokenizer(home.store)).figures
    assert data["recounted_tokens"] == data["ledger_tokens"] > 0

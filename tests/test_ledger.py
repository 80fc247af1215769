"""The token ledger: shard records, run parts and their chain, reuse / repeat / replay / leakage,
and an independent recount of what the files hold against what the ledger says."""

from __future__ import annotations

import dataclasses
import json
import uuid
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ghostvis_core.counts import TokenCounts
from ghostvis_core.data.ledger import Ledger, records
from ghostvis_core.data.ledger.files import write_parquet
from ghostvis_core.data.ledger.records import (
    PART_SCHEMA,
    PART_TABLES,
    NgramRow,
    RowIndexRow,
    ShareRow,
)
from ghostvis_core.data.ledger.summaries import run_summaries
from ghostvis_core.data.ledger.write import pieces_to_rows
from ghostvis_core.data.loader import Batcher, Consumption, LMRows, merge_pieces, micro_batch_rows
from ghostvis_core.data.shard_ref import ShardRef
from ghostvis_core.data.stream import SourceStream
from ghostvis_core.data.token_shard import TokenShard, list_column, write_token_shard
from ghostvis_core.errors import GhostvisError
from ghostvis_core.plan.batch import BatchPlan
from ghostvis_core.store import S3Store
from ghostvis_core.verify.audit.invariants import no_reuse
from tests.conftest import new_bucket, s3_env
from tests.ledger_rows import part, piece, shard_record, write


@pytest.fixture
def ledger(tmp_path) -> Ledger:
    return Ledger(tmp_path / "ledger")


def ngram(shard_id: str, split: str, sha: str, row: int, ngram_hash: int) -> NgramRow:
    """One fingerprint of a document (raw `row`) of a shard whose source is the shard id's folder."""
    return NgramRow(shard_id, shard_id.split("/")[0], split, sha, row, ngram_hash)


# ---------------------------------------------------------------- shards


def test_shards_newest_record_per_shard_and_tokenizer(ledger):
    ledger.write_shard(shard_record("prose-000", tokens=50, sha="old", created_at=100.0))
    ledger.write_shard(shard_record("prose-000", tokens=60, sha="new", created_at=200.0))  # raw shard changed
    ledger.write_shard(shard_record("prose-000", tokenizer_id="tok-b", tokens=70, created_at=150.0))
    ledger.write_shard(shard_record("code-000", source="code", tokens=30, created_at=120.0))
    got = {(r.shard_id, r.tokenizer_id): r.tokens for r in ledger.shards()}
    assert got == {("prose-000", "tok-a"): 60, ("prose-000", "tok-b"): 70, ("code-000", "tok-a"): 30}
    assert [r.shard_id for r in ledger.shards()][0] == "code-000"  # ordered by shard_id


def test_shards_filters(ledger):
    ledger.write_shard(shard_record("prose-000", tokens=60))
    ledger.write_shard(shard_record("prose-000", tokenizer_id="tok-b", tokens=70))
    ledger.write_shard(shard_record("code-000", source="code", tokens=30))
    ledger.write_shard(shard_record("web-000", source="web", tokens=5))
    assert sorted((r.shard_id, r.tokens) for r in ledger.shards(tokenizer_id="tok-a")) == [
        ("code-000", 30),
        ("prose-000", 60),
        ("web-000", 5),
    ]
    assert [(r.shard_id, r.tokens) for r in ledger.shards(tokenizer_id="tok-b")] == [("prose-000", 70)]
    assert [r.shard_id for r in ledger.shards(sources=["code"])] == ["code-000"]
    assert sorted(r.shard_id for r in ledger.shards(tokenizer_id="tok-a", sources=["code", "web"])) == [
        "code-000",
        "web-000",
    ]
    assert ledger.shards(tokenizer_id="tok-zzz") == []


def test_writing_the_same_shard_record_twice_is_harmless(ledger):
    rec = shard_record("prose-000", tokens=60, created_at=5.0)
    p1 = ledger.write_shard(rec)
    p2 = ledger.write_shard(rec)
    assert p1 == p2 and len(list((ledger.root / "shards").glob("*.parquet"))) == 1
    assert len(ledger.shards()) == 1
    assert not list((ledger.root / "shards").glob(".*"))  # no temp files left behind


def test_empty_ledger(ledger):
    assert ledger.shards() == [] and ledger.parts() == [] and ledger.chain("nope") == []
    assert ledger.run_totals("nope") == records.RunTotals(
        TokenCounts(), overlap_tokens=0, steps=0, segments=(), parts=0
    )
    assert ledger.reuse("nope") == [] and ledger.leakage("nope") == []


# ---------------------------------------------------------------- chain and totals


@pytest.fixture
def resumed_run(ledger) -> Ledger:
    """Run 'r': segment 0 wrote p0 (steps 1-10) and p1 (11-20); p1's checkpoint was lost and segment 1
    resumed from p0's, writing p2 (11-20, prev p0) and p3 (21-30, prev p2). p1 is orphaned."""
    write(
        ledger,
        part("r.p0", "r", steps=(1, 10), real=100, pad=1, loss=90, cropped=2, created_at=1.0),
        [piece("s0", (0, 40), (0, 4))],
    )
    write(
        ledger,
        part(
            "r.p1",
            "r",
            steps=(11, 20),
            prev="r.p0",
            real=1000,
            pad=100,
            loss=900,
            cropped=200,
            overlap=7,
            created_at=2.0,
        ),
        [piece("s0", (40, 80), (4, 8)), piece("v0", (0, 10), (0, 1), split="validation")],
    )
    write(
        ledger,
        part("r.p2", "r", segment=1, steps=(11, 20), prev="r.p0", real=200, pad=3, loss=180, cropped=4, created_at=3.0),
        [piece("s0", (50, 90), (5, 9))],
    )
    write(
        ledger,
        part("r.p3", "r", segment=1, steps=(21, 30), prev="r.p2", real=300, pad=5, loss=270, cropped=6, created_at=4.0),
        [piece("s0", (90, 130), (9, 13))],
    )
    return ledger


def test_chain_follows_prev_part_links(resumed_run):
    assert [p.part_id for p in resumed_run.chain("r")] == ["r.p0", "r.p2", "r.p3"]
    assert [p.part_id for p in resumed_run.parts(["r"])] == ["r.p0", "r.p1", "r.p2", "r.p3"]


def test_run_totals_sum_the_chain_and_ignore_the_orphan(resumed_run):
    t = resumed_run.run_totals("r")
    assert t.counts == TokenCounts(real_tokens=600, pad_tokens=9, loss_tokens=540, cropped_tokens=12)
    assert t.overlap_tokens == 0  # the orphan's 7 are not counted
    assert t.steps == 30 and t.segments == (0, 1) and t.parts == 3


def test_segments_are_the_chains_launches(resumed_run):
    """Per segment of the chain: its first and last step, world size and real tokens (the orphan p1's not)."""
    assert resumed_run.segments("r") == [
        records.Segment(0, first_step=1, world_size=2, real_tokens=100, last_step=10),
        records.Segment(1, first_step=11, world_size=2, real_tokens=500, last_step=30),
    ]


def test_consumed_by_shard_along_the_chain(resumed_run):
    (s0,) = resumed_run.consumed_by_shard("r")  # v0 was only read by the orphan
    assert s0 == records.ShardConsumption("prose", "s0", "train", tokens=120, row_start=0, row_end=13, epochs=1)


def test_reuse_same_run_same_epoch(resumed_run):
    rows = resumed_run.reuse("r")
    assert len(rows) == 1
    r = rows[0]
    # p1 read s0 [40,80) rows [4,8); p2 read s0 [50,90) rows [5,9): both in epoch 0
    assert r.kind == "reuse"
    assert {r.part_a, r.part_b} == {"r.p1", "r.p2"}
    assert (r.shard_id, r.tok_start, r.tok_end, r.tokens) == ("s0", 50, 80, 30)
    assert (r.row_start, r.row_end) == (5, 8)
    assert (r.epoch_a, r.epoch_b) == (0, 0)


DAMAGED = {"checkpoint": "step_000000020", "step": 20, "reason": "model.safetensors has sha256 0a1b..., COMPLETE ..."}


@pytest.mark.parametrize("declared", [[DAMAGED], [{**DAMAGED, "step": 30}], []])
def test_steps_trained_again_after_a_damaged_checkpoint_are_declared_not_reuse(ledger, declared):
    """Segment 1 resumed from step 10 because p1's checkpoint (step 20) was damaged, and says so in its parts:
    the range p1 and p2 both read is retrained_after_fallback, naming the checkpoint and why; a declaration
    of another checkpoint, or none, leaves it reuse. A part file written before `passed_over` existed reads
    beside the new ones (columns by name)."""
    old_schema = pa.schema([f for f in PART_SCHEMA if f.name != "passed_over"])
    write(ledger, part("r.p0", "r", steps=(1, 10), created_at=1.0), [piece("s0", (0, 40), (0, 4))])
    old_file = ledger.part_file("parts", part("r.p0", "r", steps=(1, 10)))
    old_row = {k: v for k, v in dataclasses.asdict(part("r.p0", "r")).items() if k != "passed_over"}
    write_parquet(old_file, [old_row], old_schema)
    write(ledger, part("r.p1", "r", steps=(11, 20), prev="r.p0", created_at=2.0), [piece("s0", (40, 80), (4, 8))])
    for i, (steps, tok, rows) in enumerate([((11, 20), (40, 80), (4, 8)), ((21, 30), (80, 120), (8, 12))], start=2):
        write(
            ledger,
            part(
                f"r.p{i}",
                "r",
                segment=1,
                steps=steps,
                prev=f"r.p{0 if i == 2 else 2}",
                created_at=float(i + 1),
                passed_over=json.dumps(declared),
            ),
            [piece("s0", tok, rows)],
        )
    (r,) = ledger.reuse("r")
    assert ({r.part_a, r.part_b}, r.tok_start, r.tok_end, r.tokens) == ({"r.p1", "r.p2"}, 40, 80, 40)
    outcome = no_reuse(ledger, "r")
    if declared == [DAMAGED]:
        assert (r.kind, r.checkpoint, r.reason) == (
            "retrained_after_fallback",
            "step_000000020",
            DAMAGED["reason"],
        )
        assert outcome.passed and outcome.failures == []
        assert outcome.figures["reused_tokens"] == 0 and outcome.figures["retrained_after_fallback_tokens"] == 40
        assert outcome.figures["passed_over_checkpoints"] == "step_000000020"
        assert outcome.tables["ranges"][1][0][-1] == f"step_000000020: {DAMAGED['reason']}"
    else:
        assert (r.kind, r.checkpoint, r.reason) == ("reuse", "", "")
        assert not outcome.passed and outcome.figures["reused_tokens"] == 40
        assert outcome.failures == [
            "reuse s0 tokens 40..80: read by part r.p1 (segment 0, steps 11..20) and "
            "part r.p2 (segment 1, steps 11..20)"
        ]


@pytest.mark.parametrize("allow_repeat, kind", [(True, "repeat"), (False, "undeclared_repeat")])
def test_repeat_in_another_epoch(ledger, allow_repeat, kind):
    write(
        ledger,
        part("e.p0", "e", steps=(1, 10), allow_repeat=allow_repeat, created_at=1.0),
        [piece("s0", (0, 100), (0, 10))],
    )
    write(
        ledger,
        part("e.p1", "e", steps=(11, 20), prev="e.p0", allow_repeat=allow_repeat, created_at=2.0),
        [piece("s0", (0, 30), (0, 3), epoch=1)],
    )
    (r,) = ledger.reuse("e")
    assert r.kind == kind
    assert (r.tok_start, r.tok_end, r.tokens, r.row_start, r.row_end) == (0, 30, 30, 0, 3)
    assert {r.epoch_a, r.epoch_b} == {0, 1}


@pytest.mark.parametrize("allow_repeat, kind", [(True, "repeat"), (False, "undeclared_repeat")])
def test_repeat_within_one_part(ledger, allow_repeat, kind):
    write(
        ledger,
        part("w.p0", "w", allow_repeat=allow_repeat),
        [piece("s0", (0, 100), (0, 10)), piece("s0", (0, 25), (0, 3), epoch=1)],
    )
    (r,) = ledger.reuse("w")
    assert r.kind == kind and r.part_a == r.part_b == "w.p0"
    assert (r.tok_start, r.tok_end, r.tokens, r.row_start, r.row_end) == (0, 25, 25, 0, 3)


@pytest.fixture
def parent_run(ledger) -> Ledger:
    write(
        ledger,
        part("pre.p0", "pre", created_at=1.0),
        [piece("s0", (0, 100), (0, 10)), piece("c0", (0, 50), (0, 5), source="code")],
    )
    return ledger


@pytest.mark.parametrize(
    "replay, kind", [("[]", "undeclared_cross_stage"), ('["code"]', "undeclared_cross_stage"), ('["prose"]', "replay")]
)
def test_child_run_overlapping_its_parent(parent_run, replay, kind):
    write(
        parent_run,
        part("cpt.p0", "cpt", parent="pre", stage="continued_pretrain", replay=replay, created_at=2.0),
        [piece("s0", (60, 120), (6, 12))],
    )
    assert parent_run.lineage("cpt") == ["cpt", "pre"]
    (r,) = parent_run.reuse("cpt")
    assert r.kind == kind
    assert {r.run_a, r.run_b} == {"pre", "cpt"}
    assert (r.shard_id, r.source, r.tok_start, r.tok_end, r.tokens) == ("s0", "prose", 60, 100, 40)
    assert (r.row_start, r.row_end) == (6, 10)
    assert parent_run.reuse("pre") == []  # the parent's own lineage does not include the child


def test_no_reuse_names_the_setting_that_declares_a_replay(parent_run):
    from ghostvis_core.verify.audit.invariants import no_reuse

    write(
        parent_run,
        part("cpt.p0", "cpt", parent="pre", stage="continued_pretrain", created_at=2.0),
        [piece("s0", (60, 120), (6, 12))],
    )
    out = no_reuse(parent_run, "cpt")
    assert not out.passed and len(out.failures) == 2
    assert out.failures[1] == (
        "40 tokens of source(s) prose were read by an earlier stage of this lineage and again by this one: expected "
        "when this stage replays them on purpose (a replay mix, or one source declared for two stages); declare it "
        "with --set 'data.replay_sources=[\"prose\"]' (the run config's data.replay_sources, keeping any source "
        "already declared there), else give this stage data its lineage has not read"
    )


def test_no_reuse_names_the_setting_that_declares_a_repeat(ledger):
    from ghostvis_core.verify.audit.invariants import no_reuse

    write(ledger, part("w.p0", "w"), [piece("s0", (0, 100), (0, 10)), piece("s0", (0, 25), (0, 3), epoch=1)])
    out = no_reuse(ledger, "w")
    assert out.failures[-1] == (
        "source(s) prose were read in a second epoch by this run (the budget is larger than the data): declare it "
        "with --set data.allow_repeat=true, or lower budget.steps or add data"
    )


def test_grandchild_sees_the_grandparent(parent_run):
    write(
        parent_run,
        part("cpt.p0", "cpt", parent="pre", stage="continued_pretrain", created_at=2.0),
        [piece("s0", (100, 150), (10, 15))],
    )
    write(
        parent_run,
        part("ctx.p0", "ctx", parent="cpt", stage="context_expansion", created_at=3.0),
        [piece("c0", (40, 60), (4, 6), source="code")],
    )
    assert parent_run.lineage("ctx") == ["ctx", "cpt", "pre"]
    (r,) = parent_run.reuse("ctx")
    assert (r.kind, r.shard_id, r.tok_start, r.tok_end) == ("undeclared_cross_stage", "c0", 40, 50)


def test_disjoint_or_touching_ranges_are_not_reuse(parent_run):
    write(
        parent_run,
        part("cpt.p0", "cpt", parent="pre", stage="continued_pretrain", created_at=2.0),
        [
            piece("s0", (100, 150), (10, 15)),  # touches the parent's [0,100), no overlap
            piece("s1", (0, 100), (0, 10)),  # another shard
            piece("c0", (50, 80), (5, 8), source="code"),
        ],
    )
    write(
        parent_run,
        part("cpt.p1", "cpt", parent="pre", stage="continued_pretrain", steps=(11, 20), prev="cpt.p0", created_at=3.0),
        [piece("s0", (150, 200), (15, 20))],
    )
    assert parent_run.reuse("cpt") == []


def test_unrelated_runs_are_not_compared(parent_run):
    write(parent_run, part("other.p0", "other", created_at=2.0), [piece("s0", (0, 100), (0, 10))])
    assert parent_run.reuse("other") == []


# ---------------------------------------------------------------- leakage


def test_leakage_lists_validation_shards_trained_on(ledger):
    ledger.write_shard(shard_record("s0"))
    ledger.write_shard(shard_record("v0", split="validation"))
    write(
        ledger,
        part("l.p0", "l", created_at=1.0),
        [piece("s0", (0, 100), (0, 10)), piece("v0", (0, 30), (0, 3), split="validation")],
    )
    write(
        ledger,
        part("l.p1", "l", steps=(11, 20), prev="l.p0", created_at=2.0),
        [piece("v0", (30, 50), (3, 5), split="validation")],
    )
    (leak,) = ledger.leakage("l")
    assert leak.consumed == records.ShardConsumption(
        "prose", "v0", "validation", tokens=50, row_start=0, row_end=5, epochs=1
    )
    assert (leak.split, leak.label, leak.consumed.rows) == ("validation", "validation", "0..5")


def test_no_leakage_when_only_train_shards(ledger):
    ledger.write_shard(shard_record("s0"))
    write(ledger, part("ok.p0", "ok"), [piece("s0", (0, 100), (0, 10))])
    assert ledger.leakage("ok") == []


def test_orphan_part_leakage_is_not_on_the_chain(resumed_run):
    resumed_run.write_shard(shard_record("s0"))
    assert resumed_run.leakage("r") == []  # only the orphaned p1 read v0


# ---------------------------------------------------------------- independent recount


def test_ledger_totals_equal_the_files_and_the_loader(tmp_path, ledger):
    """Write token shards, record them, train-read them through the loader, write the parts as the
    loop does; then recount everything from the files and compare."""
    rng = np.random.default_rng(42)
    refs = []
    expected_tokens = {}
    for k in range(4):
        lengths = [int(x) for x in rng.integers(3, 60, size=int(rng.integers(2, 8)))]
        flat = rng.integers(0, 4000, size=sum(lengths)).tolist()
        path = tmp_path / "tokens" / f"prose-{k:03d}.arrow"
        write_token_shard(
            path,
            {"row": pa.array(np.arange(len(lengths)), pa.int64()), "tokens": list_column(lengths, flat, np.uint16)},
        )
        expected_tokens[f"prose-{k:03d}"] = sum(lengths)
        ledger.write_shard(
            shard_record(
                f"prose-{k:03d}", tokens=sum(lengths), docs=len(lengths), token_path=str(path), created_at=float(k)
            )
        )
    records = ledger.shards()
    on_disk = {r.shard_id: TokenShard.open(Path(r.token_path)).num_tokens for r in records}
    assert on_disk == expected_tokens
    assert sum(r.tokens for r in records) == sum(on_disk.values())
    assert sum(r.docs for r in records) == sum(TokenShard.open(Path(r.token_path)).num_docs for r in records)

    # consume 3 steps of 2 x 8 x 2 x 2 (= 64 tokens/step) in two parts, as the training loop records them
    refs = [ShardRef(r.shard_id, r.source, r.split, r.token_path, r.docs, r.tokens) for r in records]
    stream = SourceStream("prose", refs, seed=0)
    batcher = Batcher([LMRows(stream, 8)], [1.0])
    plan = BatchPlan(2, 8, 2, 2)
    shard_by_id = {r.shard_id: stream.shard(r) for r in refs}
    rows, prev = 0, ""
    for pi, steps in enumerate([(1, 2), (3, 3)]):
        cons = Consumption()
        for _ in range(steps[0], steps[1] + 1):
            for m in range(plan.grad_accum_steps):
                for r in range(plan.world_size):
                    cons.add(batcher.batch(micro_batch_rows(rows, m, r, plan)))
            rows += plan.rows_per_step
        merged, overlap = merge_pieces(cons.pieces)
        pid = f"t.p{pi}"
        c = cons.counts
        row = part(
            pid,
            "t",
            steps=steps,
            prev=prev,
            real=c.real_tokens,
            pad=c.pad_tokens,
            loss=c.loss_tokens,
            cropped=c.cropped_tokens,
            overlap=overlap,
            created_at=10.0 + pi,
        )
        ledger.write_part(
            row, pieces_to_rows(row, merged, lambda p: shard_by_id[p.shard_id].rows_of(p.tok_start, p.tok_end))
        )
        prev = pid
    totals = ledger.run_totals("t")
    assert totals.counts.real_tokens == 3 * 64 == 192 and totals.steps == 3 and totals.overlap_tokens == 0
    per_shard = ledger.consumed_by_shard("t")
    assert sum(r.tokens for r in per_shard) == 192  # consumption rows add up to real_tokens
    total_available = sum(on_disk.values())
    assert total_available > 192 + 1  # the data holds more than was read: all of it is epoch 0
    assert ledger.reuse("t") == []
    assert {r.epochs for r in per_shard} == {1}
    for r in per_shard:
        assert r.tokens <= on_disk[r.shard_id]
        n_docs = next(x.docs for x in records if x.shard_id == r.shard_id)
        assert 0 <= r.row_start < r.row_end <= n_docs


# ---------------------------------------------------------------- layout: a folder per run


def garble_run(ledger: Ledger, stage: str, run_key: str) -> int:
    """Overwrite every file of a run's folders with bytes no Parquet reader accepts; returns how many."""
    files = [f for table in PART_TABLES for f in (ledger.root / table / f"stage={stage}" / f"run={run_key}").glob("*")]
    for f in files:
        f.write_bytes(b"not parquet")
    return len(files)


def test_a_query_about_one_run_opens_only_that_runs_files(parent_run):
    write(
        parent_run,
        part("cpt.p0", "cpt", parent="pre", stage="continued_pretrain", real=50, created_at=2.0),
        [piece("s0", (60, 120), (6, 12))],
        shares=[ShareRow("cpt.p0", "cpt", rank=0, world_size=1, row_count=6, row_ranges=[[6, 12]], real_tokens=50)],
    )
    write(parent_run, part("other.p0", "other", real=7, created_at=3.0), [piece("s9", (0, 10), (0, 1))])
    assert parent_run.part_file("shares", parent_run.chain("cpt")[0]) == (
        parent_run.root / "shares" / "stage=continued_pretrain" / "run=cpt" / "s000.p000000010.parquet"
    )
    assert garble_run(parent_run, "pretrain", "other") == 2  # its part row and its consumption
    with pytest.raises(duckdb.Error):  # the garbled files are really unreadable: a query that opened them fails
        parent_run.parts()
    chain = parent_run.chain("cpt")
    assert [p.part_id for p in chain] == ["cpt.p0"] and parent_run.run_totals("cpt").counts.real_tokens == 50
    assert [(r.shard_id, r.tok_start) for r in parent_run.consumption(chain)] == [("s0", 60)]
    assert [r.row_ranges for r in parent_run.shares(chain)] == [[[6, 12]]]
    assert [r.kind for r in parent_run.reuse("cpt")] == ["undeclared_cross_stage"]  # reads "pre" too, not "other"
    assert [p.run_key for p in parent_run.parts(stage="continued_pretrain")] == ["cpt"]
    garble_run(parent_run, "pretrain", "pre")
    assert parent_run.consumed_by_shard("cpt")[0].tokens == 60  # the chain's own run only


def test_run_summaries_equal_each_runs_totals(resumed_run, parent_run):
    summaries = {r.run_key: r for r in run_summaries(resumed_run)}
    assert sorted(summaries) == ["pre", "r"]
    for key, s in summaries.items():
        assert s.totals == resumed_run.run_totals(key)
    r = summaries["r"]
    assert (r.totals.counts.real_tokens, r.totals.parts, r.planned_tokens) == (600, 3, 960)
    assert list(r.as_dict())[:6] == [
        "stage",
        "run_key",
        "parent_run_key",
        "planned_tokens",
        "tokens_per_step",
        "real_tokens",
    ]  # fmt: skip  (ghostvis ledger --json's order)


def test_a_run_key_that_cannot_name_a_folder_is_refused(ledger):
    with pytest.raises(GhostvisError, match="run_key 'a/b' cannot name a folder"):
        write(ledger, part("x.p0", "a/b"), [])
    assert not (ledger.root / "parts").exists()


# ---------------------------------------------------------------- through the artifact store


def test_the_ledger_writes_and_reads_through_the_store(store_nodes):
    """Files written on one node are read on the other (a folder store, and a bucket store with a cache
    per node): the ledger publishes each file it writes and fetches the folders a query reads."""
    written, read = Ledger.in_store(store_nodes.writer), Ledger.in_store(store_nodes.reader)
    written.write_shard(shard_record("web/00001", tokens=30))
    write(written, part("k.p0", "k", real=30), [piece("web/00001", (0, 30), (0, 3))])
    assert [(r.shard_id, r.tokens) for r in read.shards()] == [("web/00001", 30)]
    assert [p.part_id for p in read.parts(["k"], stage="pretrain")] == ["k.p0"]
    assert read.run_totals("k").counts.real_tokens == 30
    assert [r.tokens for r in read.consumed_by_shard("k")] == [30]


def test_on_a_bucket_a_query_about_one_run_lists_only_that_runs_folder(moto_s3, tmp_path, monkeypatch):
    for var, value in s3_env(moto_s3, tmp_path).items():
        monkeypatch.setenv(var, value)
    bucket = f"b-{uuid.uuid4().hex[:10]}"
    new_bucket(moto_s3, bucket)
    writer = Ledger.in_store(S3Store(bucket, "store", tmp_path / "a"))
    for key in ("k1", "k2"):
        write(writer, part(f"{key}.p0", key, real=5), [piece("s0", (0, 5), (0, 1))])
    reader = S3Store(bucket, "store", tmp_path / "b")
    listed = []
    reader.s3.meta.events.register(
        "provide-client-params.s3.ListObjectsV2", lambda params, **_: listed.append(params["Prefix"])
    )
    assert [p.part_id for p in Ledger.in_store(reader).parts(["k1"], stage="pretrain")] == ["k1.p0"]
    assert listed and all(p.startswith("store/ledger/parts/stage=pretrain/run=k1") for p in listed), listed
    assert not (tmp_path / "b" / "ledger" / "parts" / "stage=pretrain" / "run=k2").exists()


# ---------------------------------------------------------------- the indexes `ghostvis trace` reads


def test_a_runs_row_index_is_named_by_its_chains_head_and_read_where_a_filter_can_match(resumed_run):
    """run_heads lists each run's newest part file without reading it; the row index of a chain is one file
    beside that head's name, so a chain that grew needs a new one; row_index reads the rows that match a
    filter, in row-rule order (step, rank, micro-batch, row); run_links reads only the heads."""
    ledger = resumed_run
    write(ledger, part("q.p0", "q", stage="sft", parent="r"), [piece("s0", (0, 40), (3, 6))])
    heads = ledger.run_heads()
    assert [(h.stage, h.run_key, h.head.name) for h in heads] == [
        ("pretrain", "r", "s001.p000000030.parquet"),
        ("sft", "q", "s000.p000000010.parquet"),
    ]
    assert {(r.run_key, r.parent_run_key) for r in ledger.run_links(heads)} == {("r", ""), ("q", "r")}
    chain = ledger.chain("r")
    assert [p.part_id for p in chain] == ["r.p0", "r.p2", "r.p3"]
    index = ledger.row_index_file(heads[0].head)
    assert index == ledger.root / "row_index/stage=pretrain/run=r/s001.p000000030.parquet" and not index.is_file()
    rows = [
        RowIndexRow(
            "r.p2",
            "r",
            "pretrain",
            1,
            step=11 + g // 8,
            rank=g % 2,
            micro_batch=0,
            global_row=80 + g,
            shard_id=s,
            epoch=0,
            tok_start=50 + 4 * g,
            tok_end=54 + 4 * g,
            row_start=5 + g // 3,
            row_end=6 + g // 3,
        )  # fmt: skip
        for g in range(16)
        for s in ("s0", "s1")
    ]
    assert ledger.write_row_index(chain, rows) == index and index.is_file()
    got = ledger.row_index([index], "shard_id = ? AND row_start <= ? AND ? < row_end", ["s1", 5, 5])
    assert [(r.global_row, r.rank, r.segment, r.stage, r.run_key) for r in got] == [
        (80, 0, 1, "pretrain", "r"),
        (82, 0, 1, "pretrain", "r"),
        (81, 1, 1, "pretrain", "r"),
    ]
    step_12 = [r.global_row for r in ledger.row_index([index], "step = ?", [12])]
    assert step_12 == [g for rank in (0, 1) for g in range(88 + rank, 96, 2) for _ in ("s0", "s1")]
    write(ledger, part("r.p4", "r", segment=1, steps=(31, 40), prev="r.p3"), [piece("s0", (130, 170), (13, 17))])
    assert not ledger.row_index_file(ledger.run_heads()[0].head).is_file()  # the chain grew: a new index


def test_the_fingerprint_index_holds_every_shard_and_texts_are_found_in_files_written_since(ledger):
    """write_ngram_index puts every shard's fingerprints into one file sorted by hash; a shard fingerprinted
    after it is read from its own file until the next index, and the newest index is the one read."""
    ledger.write_ngrams("a/0", "sha-a", [ngram("a/0", "train", "sha-a", r, h) for r, h in ((0, 7), (0, 9), (1, 9))])
    ledger.write_ngrams("a/1", "sha-b", [ngram("a/1", "train", "sha-b", 4, 9)])
    first = ledger.write_ngram_index()
    assert ledger.ngram_files() == [first] and ledger.write_ngram_index() == first  # written once
    assert pq.read_table(first).column("ngram_hash").to_pylist() == [7, 9, 9, 9]
    ledger.write_ngrams("b/0", "sha-c", [ngram("b/0", "validation", "sha-c", 2, h) for h in (7, 9)])
    assert ledger.ngram_files()[0] == first and len(ledger.ngram_files()) == 2
    found = ledger.documents_sharing([7, 9])
    assert found == [
        records.SharedDocument("a/0", "sha-a", "train", row=0, shared=2),
        records.SharedDocument("b/0", "sha-c", "validation", row=2, shared=2),
        records.SharedDocument("a/0", "sha-a", "train", row=1, shared=1),
        records.SharedDocument("a/1", "sha-b", "train", row=4, shared=1),
    ]
    assert ledger.document_fingerprints(["sha-c", "sha-a"]) == [
        records.DocumentFingerprints("a/0", "sha-a", 0, [7, 9]),
        records.DocumentFingerprints("a/0", "sha-a", 1, [9]),
        records.DocumentFingerprints("b/0", "sha-c", 2, [7, 9]),
    ]
    second = ledger.write_ngram_index()
    assert second != first and ledger.ngram_files() == [second]
    assert ledger.documents_sharing([7, 9]) == found

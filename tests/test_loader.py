"""The training loader on hand-built token shards: windows, accounting, pieces, epochs, world-size
independence, resume-as-seek, and the mixture schedule.

Shards are written with write_token_shard. Token values are chosen so that position p of a source's
epoch-0 stream holds a known value (e.g. 100 + p), which makes every expected window hand-checkable.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from ghostvis_core.data.loader import Batcher, ChatRows, Consumption, LMRows, merge_pieces, micro_batch_rows
from ghostvis_core.data.shard_piece import Piece
from ghostvis_core.data.shard_ref import ShardRef
from ghostvis_core.data.stream import SourceStream
from ghostvis_core.data.token_shard import TokenShard, list_column, write_token_shard
from ghostvis_core.errors import GhostvisError
from ghostvis_core.plan.batch import IGNORE_INDEX, BatchPlan
from ghostvis_core.plan.mixture import MixtureSchedule

# ---------------------------------------------------------------- helpers


def write_shard(
    root: Path,
    source: str,
    shard_id: str,
    docs: list[list[int]],
    rows: list[int] | None = None,
    split: str = "train",
    extra: dict[str, pa.Array] | None = None,
) -> ShardRef:
    rows = list(range(len(docs))) if rows is None else rows
    path = root / source / f"{shard_id}.arrow"
    flat = [t for d in docs for t in d]
    write_token_shard(
        path,
        {
            "row": pa.array(rows, pa.int64()),
            "tokens": list_column([len(d) for d in docs], flat, np.uint16),
            **(extra or {}),
        },
    )
    return ShardRef(shard_id=shard_id, source=source, split=split, path=str(path), docs=len(docs), tokens=len(flat))


@pytest.fixture
def prose(tmp_path) -> list[ShardRef]:
    """Source 'prose': 25 tokens; epoch-0 stream position p holds token 100 + p.
    prose-000: docs [100..104] (raw row 0), [105..111] (raw row 2; row 1 was dropped upstream)
    prose-001: docs [112..120] (raw row 0), [121..124] (raw row 1)"""
    a = write_shard(tmp_path, "prose", "prose-000", [list(range(100, 105)), list(range(105, 112))], rows=[0, 2])
    b = write_shard(tmp_path, "prose", "prose-001", [list(range(112, 121)), list(range(121, 125))], rows=[0, 1])
    return [b, a]  # given out of order on purpose: the stream sorts by shard_id


@pytest.fixture
def code(tmp_path) -> list[ShardRef]:
    """Source 'code': one shard of 12 tokens, 500..511 (two docs of 6)."""
    return [write_shard(tmp_path, "code", "code-000", [list(range(500, 506)), list(range(506, 512))])]


def piece_tokens(refs: list[ShardRef], p: Piece) -> np.ndarray:
    ref = next(r for r in refs if r.shard_id == p.shard_id)
    return TokenShard.open(Path(ref.path)).slice(p.tok_start, p.tok_end).astype(np.int64)


# ---------------------------------------------------------------- windows and accounting


def test_rows_are_stride_seq_len_windows_of_seq_len_plus_one(prose):
    b = Batcher([LMRows(SourceStream("prose", prose, seed=1), 4)], [1.0])
    batch = b.batch(range(0, 6))  # rows 0..5 read stream [0, 25): all of epoch 0
    assert batch.inputs.dtype == torch.int64 and batch.inputs.shape == (6, 4)
    for g in range(6):
        assert batch.inputs[g].tolist() == [100 + 4 * g + k for k in range(4)]
        assert batch.targets[g].tolist() == [101 + 4 * g + k for k in range(4)]
    # explicit spot checks: row 2 crosses from prose-000 into prose-001; row 5 ends on the last token
    assert batch.inputs[2].tolist() == [108, 109, 110, 111] and batch.targets[2].tolist() == [109, 110, 111, 112]
    assert batch.targets[5].tolist() == [121, 122, 123, 124]


def test_real_pad_loss_counts(prose):
    b = Batcher([LMRows(SourceStream("prose", prose, seed=1), 4)], [1.0])
    batch = b.batch(range(0, 3))
    assert batch.counts.as_list() == [12, 0, 12, 0]
    assert int((batch.targets != IGNORE_INDEX).sum()) == 12
    c = Consumption()
    c.add(batch)
    c.add(b.batch(range(3, 5)))
    assert c.counts.as_list() == [20, 0, 20, 0]  # 5 rows x 4


def test_pieces_cover_exactly_the_input_tokens(prose):
    b = Batcher([LMRows(SourceStream("prose", prose, seed=1), 4)], [1.0])
    batch = b.batch(range(0, 4))
    # row 0 reads [0,5) -> inputs [0,4); row 1 [4,8); row 2 [8,12) of prose-000 (its 13th token,
    # prose-001's first, is only a target and is dropped from the pieces); row 3 prose-001 [0,4)
    assert [(p.shard_id, p.epoch, p.tok_start, p.tok_end) for p in batch.pieces] == [
        ("prose-000", 0, 0, 4),
        ("prose-000", 0, 4, 8),
        ("prose-000", 0, 8, 12),
        ("prose-001", 0, 0, 4),
    ]
    assert sum(p.tokens for p in batch.pieces) == batch.counts.real_tokens == 16
    # the pieces, read back from disk, are the input tokens in order
    assert np.concatenate([piece_tokens(prose, p) for p in batch.pieces]).tolist() == batch.inputs.reshape(-1).tolist()
    merged, overlap = merge_pieces(batch.pieces)
    assert overlap == 0
    assert [(p.shard_id, p.tok_start, p.tok_end) for p in merged] == [("prose-000", 0, 12), ("prose-001", 0, 4)]


def test_pieces_map_to_raw_rows(prose):
    a = TokenShard.open(Path(next(r for r in prose if r.shard_id == "prose-000").path))
    b = TokenShard.open(Path(next(r for r in prose if r.shard_id == "prose-001").path))
    # prose-000: doc 0 = tokens [0,5) raw row 0; doc 1 = tokens [5,12) raw row 2
    assert a.rows_of(0, 12) == (0, 3)
    assert a.rows_of(0, 4) == (0, 1)
    assert a.rows_of(4, 8) == (0, 3)  # token 4 is doc 0's last, 5..7 are doc 1
    assert a.rows_of(5, 8) == (2, 3)  # doc 1 only
    assert a.rows_of(8, 12) == (2, 3)
    # prose-001: doc 0 = [0,9) raw row 0; doc 1 = [9,13) raw row 1
    assert b.rows_of(0, 4) == (0, 1)
    assert b.rows_of(8, 10) == (0, 2)
    assert b.rows_of(9, 13) == (1, 2)


def test_lm_rows_start_token_offsets_the_stream(prose):
    rows = LMRows(SourceStream("prose", prose, seed=1), 4, start_token=3)
    r = rows.row(1)  # reads [3 + 4, 3 + 9)
    assert r.inputs.tolist() == [107, 108, 109, 110] and r.targets.tolist() == [108, 109, 110, 111]
    assert [(p.shard_id, p.tok_start, p.tok_end) for p in r.pieces] == [("prose-000", 7, 11)]


# ---------------------------------------------------------------- epochs


def test_epoch_wrap_single_shard(code):
    b = Batcher([LMRows(SourceStream("code", code, seed=1), 4)], [1.0])
    batch = b.batch(range(0, 5))
    # 12 tokens: rows 0,1 inside epoch 0; row 2 = epoch-0 [8,12) with epoch 1's first token as target
    assert batch.inputs[2].tolist() == [508, 509, 510, 511]
    assert batch.targets[2].tolist() == [509, 510, 511, 500]
    assert batch.inputs[3].tolist() == [500, 501, 502, 503]  # epoch 1, one shard: same order
    assert batch.inputs[4].tolist() == [504, 505, 506, 507]
    assert [(p.epoch, p.tok_start, p.tok_end) for p in batch.pieces] == [
        (0, 0, 4),
        (0, 4, 8),
        (0, 8, 12),
        (1, 0, 4),
        (1, 4, 8),
    ]
    assert sum(p.tokens for p in batch.pieces) == batch.counts.real_tokens == 20


def test_epoch_wrap_multi_shard_is_a_permutation_of_shards(prose):
    stream = SourceStream("prose", prose, seed=7)
    tokens, pieces = stream.read(25, 50)  # exactly epoch 1
    assert {p.epoch for p in pieces} == {1}
    assert sorted(p.shard_id for p in pieces) == ["prose-000", "prose-001"]
    assert all((p.tok_start, p.tokens) == (0, {"prose-000": 12, "prose-001": 13}[p.shard_id]) for p in pieces)
    assert tokens.tolist() in (list(range(100, 125)), list(range(112, 125)) + list(range(100, 112)))
    assert np.concatenate([piece_tokens(prose, p) for p in pieces]).tolist() == tokens.tolist()
    # a row that straddles epochs 0 and 1 yields pieces of both, and its inputs are theirs
    b = Batcher([LMRows(SourceStream("prose", prose, seed=7), 4)], [1.0])
    batch = b.batch(range(6, 8))  # row 6 reads [24, 29), row 7 [28, 33)
    assert batch.inputs[0, 0].item() == 124
    assert [p.epoch for p in batch.pieces][:2] == [0, 1]
    assert sum(p.tokens for p in batch.pieces) == 8
    assert np.concatenate([piece_tokens(prose, p) for p in batch.pieces]).tolist() == batch.inputs.reshape(-1).tolist()


# ---------------------------------------------------------------- rows per step, ranks, world size


def test_micro_batch_rows_partition_a_step():
    plan = BatchPlan(micro_batch_size=2, seq_len=4, world_size=2, grad_accum_steps=2)
    assert plan.rows_per_step == 8
    first = 3 * plan.rows_per_step  # step 3 starts at row 24
    got = {(m, r): list(micro_batch_rows(first, m, r, plan)) for m in range(2) for r in range(2)}
    assert got == {(0, 0): [24, 25], (0, 1): [26, 27], (1, 0): [28, 29], (1, 1): [30, 31]}
    flat = [g for rows in got.values() for g in rows]
    assert len(flat) == len(set(flat)) and sorted(flat) == list(range(24, 32))


@pytest.mark.parametrize("first", [0, 8, 800, 10**9])
def test_step_rows_identical_whatever_the_world_size(first):
    unions = []
    for ws, accum in [(1, 4), (2, 2), (4, 1)]:
        plan = BatchPlan(micro_batch_size=2, seq_len=4, world_size=ws, grad_accum_steps=accum)
        rows = [g for m in range(accum) for r in range(ws) for g in micro_batch_rows(first, m, r, plan)]
        assert len(rows) == len(set(rows)) == 8  # disjoint
        unions.append(sorted(rows))
    assert unions[0] == unions[1] == unions[2] == list(range(first, first + 8))


def test_step_tokens_identical_whatever_the_world_size(prose, code):
    """Same global rows -> the same tokens, per row, whatever the world size."""
    per_layout = []
    for ws, accum in [(1, 4), (2, 2), (4, 1)]:
        b = Batcher([LMRows(SourceStream("prose", prose, 3), 4), LMRows(SourceStream("code", code, 3), 4)], [0.7, 0.3])
        plan = BatchPlan(2, 4, ws, accum)
        by_row = {}
        for m in range(accum):
            for r in range(ws):
                rows = micro_batch_rows(16, m, r, plan)
                batch = b.batch(rows)
                for i, g in enumerate(rows):
                    by_row[g] = (batch.inputs[i].tolist(), batch.targets[i].tolist())
        per_layout.append(by_row)
    assert per_layout[0] == per_layout[1] == per_layout[2]
    assert sorted(per_layout[0]) == list(range(16, 24))


# ---------------------------------------------------------------- merge_pieces


def P(start, end, shard="s0", epoch=0):
    return Piece("src", shard, "train", epoch, start, end)


def test_merge_touching_pieces():
    merged, overlap = merge_pieces([P(4, 8), P(0, 4), P(8, 10)])
    assert merged == [P(0, 10)] and overlap == 0


def test_merge_keeps_gaps_shards_and_epochs_apart():
    merged, overlap = merge_pieces([P(0, 4), P(6, 9), P(0, 4, shard="s1"), P(0, 4, epoch=1)])
    assert overlap == 0
    assert sorted(merged, key=lambda p: (p.shard_id, p.epoch, p.tok_start)) == [
        P(0, 4),
        P(6, 9),
        P(0, 4, epoch=1),
        P(0, 4, shard="s1"),
    ]


def test_merge_reports_overlap_tokens():
    merged, overlap = merge_pieces([P(0, 6), P(4, 8)])  # tokens 4, 5 read twice
    assert merged == [P(0, 8)] and overlap == 2
    merged, overlap = merge_pieces([P(0, 10), P(2, 5)])  # contained: 3 tokens twice
    assert merged == [P(0, 10)] and overlap == 3
    # three reads: 10 + 3 + 8 = 21 tokens read, 12 distinct -> 9 read more than once
    merged, overlap = merge_pieces([P(0, 10), P(2, 5), P(4, 12)])
    assert merged == [P(0, 12)] and overlap == 9
    merged, overlap = merge_pieces([P(0, 4), P(0, 4)])  # the same piece twice
    assert merged == [P(0, 4)] and overlap == 4


# ---------------------------------------------------------------- MixtureSchedule


def test_mixture_pattern_by_hand():
    s = MixtureSchedule([0.5, 0.3, 0.2])
    assert s.counts == [500, 300, 200]
    # smooth weighted round-robin with credits +500/+300/+200, winner pays 1000, ties -> lowest index:
    # 0 1 2 0 0 1 0 2 1 0 (credits back to 0 after 10 rows, so the pattern repeats every 10)
    assert s.pattern[:10].tolist() == [0, 1, 2, 0, 0, 1, 0, 2, 1, 0]
    assert s.pattern.tolist() == [0, 1, 2, 0, 0, 1, 0, 2, 1, 0] * 100
    assert s.locate(0) == (0, 0)
    assert s.locate(7) == (2, 1)  # second row of source 2 (the first was global row 2)
    assert s.locate(1003) == (0, 501)  # cycle 1 (500 rows of source 0) + one in pattern[:3]
    assert s.rows_before(1003) == [501, 301, 201]
    assert s.rows_before(10) == [5, 3, 2]


@pytest.mark.parametrize("weights", [[0.5, 0.5], [0.5, 0.3, 0.2], [0.7, 0.2, 0.1], [0.6, 0.25, 0.15], [0.999, 0.001]])
def test_mixture_prefix_fractions_within_one_row(weights):
    """Stated tolerance: for weights that are multiples of 1/period, every prefix of N rows has
    |rows of source i - w_i * N| <= 1, at every N (checked up to 3 periods)."""
    s = MixtureSchedule(weights)
    w = np.array(weights)
    seq = np.tile(s.pattern, 3)
    onehot = np.eye(len(weights), dtype=np.int64)[seq]
    counts = np.cumsum(onehot, axis=0)  # counts[N-1, i] = rows of source i among the first N
    n = np.arange(1, len(seq) + 1)[:, None]
    assert np.abs(counts - w * n).max() <= 1.0


def test_mixture_non_representable_weights_bound():
    """1/3 each cannot be split exactly into 1000 rows (334/333/333): the per-row share is off by
    at most 1/period, so the prefix error is bounded by 1 + N/period (not by 1)."""
    s = MixtureSchedule([1 / 3, 1 / 3, 1 / 3])
    assert s.counts == [334, 333, 333]
    seq = np.tile(s.pattern, 3)
    counts = np.cumsum(np.eye(3, dtype=np.int64)[seq], axis=0)
    n = np.arange(1, len(seq) + 1)[:, None]
    assert (np.abs(counts - n / 3) <= 1 + n / 1000).all()
    assert np.abs(counts - np.array(s.counts) / 1000 * n).max() <= 1.0


def test_mixture_locate_and_rows_before_agree_with_brute_force():
    s = MixtureSchedule([0.6, 0.25, 0.15], period=40)
    assert s.counts == [24, 10, 6]
    seen = [0, 0, 0]
    for g in range(500):  # 12.5 periods
        assert s.rows_before(g) == seen
        src = int(s.pattern[g % 40])
        assert s.locate(g) == (src, seen[src])
        seen[src] += 1
    assert seen == [300, 125, 75]  # 12.5 x (24, 10, 6)


def test_mixture_weight_below_one_over_period_is_refused():
    with pytest.raises(GhostvisError, match="below 1/1000"):
        MixtureSchedule([0.9999, 0.0001])


def test_mixture_rows_per_source_in_the_batcher(prose, code):
    b = Batcher([LMRows(SourceStream("prose", prose, 3), 4), LMRows(SourceStream("code", code, 3), 4)], [0.5, 0.5])
    batch = b.batch(range(0, 4))  # pattern for 0.5/0.5 alternates: prose, code, prose, code
    assert batch.inputs[0].tolist() == [100, 101, 102, 103]
    assert batch.inputs[1].tolist() == [500, 501, 502, 503]
    assert batch.inputs[2].tolist() == [104, 105, 106, 107]
    assert batch.inputs[3].tolist() == [504, 505, 506, 507]


# ---------------------------------------------------------------- resume


@pytest.fixture
def mixture_refs(tmp_path):
    """Two sources with several shards of random-length documents; every token is unique."""
    rng = np.random.default_rng(0)
    nxt = 1
    refs = {}
    for source, n_shards in (("prose", 3), ("code", 2)):
        refs[source] = []
        for k in range(n_shards):
            docs = []
            for _ in range(int(rng.integers(3, 7))):
                n = int(rng.integers(5, 40))
                docs.append(list(range(nxt, nxt + n)))
                nxt += n
            refs[source].append(write_shard(tmp_path, source, f"{source}-{k:03d}", docs))
    return refs


def _run_steps(refs, steps: range, first_row: int, plan: BatchPlan):
    """A fresh process: new streams and batcher; returns per global row (inputs, targets) and consumption."""
    b = Batcher(
        [LMRows(SourceStream("prose", refs["prose"], 11), 8), LMRows(SourceStream("code", refs["code"], 11), 8)],
        [0.7, 0.3],
    )
    out, cons = {}, Consumption()
    rows = first_row
    for _ in steps:
        for m in range(plan.grad_accum_steps):
            for r in range(plan.world_size):
                rr = micro_batch_rows(rows, m, r, plan)
                batch = b.batch(rr)
                cons.add(batch)
                for i, g in enumerate(rr):
                    out[g] = (batch.inputs[i].tolist(), batch.targets[i].tolist())
        rows += plan.rows_per_step
    return out, cons, rows


def test_resume_equals_uninterrupted_run(mixture_refs):
    plan = BatchPlan(micro_batch_size=2, seq_len=8, world_size=2, grad_accum_steps=2)
    whole, cons_whole, end = _run_steps(mixture_refs, range(10), 0, plan)
    assert end == 80 and sorted(whole) == list(range(80))
    first, cons_a, saved_rows = _run_steps(mixture_refs, range(5), 0, plan)
    assert saved_rows == 40  # what the checkpoint stores as rows_consumed
    second, cons_b, end_b = _run_steps(mixture_refs, range(5), saved_rows, plan)
    assert end_b == 80
    assert set(first).isdisjoint(second)  # no row read twice
    assert {**first, **second} == whole  # none skipped; token for token
    # resumed with a different world size: same rows, same tokens
    second_ws4, _, _ = _run_steps(mixture_refs, range(5), saved_rows, BatchPlan(2, 8, 4, 1))
    assert second_ws4 == second
    # the ledger view agrees: same merged pieces, no overlap, counters add up
    m_whole, o_whole = merge_pieces(cons_whole.pieces)
    m_split, o_split = merge_pieces(cons_a.pieces + cons_b.pieces)
    assert o_whole == o_split == 0
    assert m_whole == m_split
    assert cons_whole.counts.real_tokens == cons_a.counts.real_tokens + cons_b.counts.real_tokens == 80 * 8


def test_seek_to_a_late_row_opens_only_the_needed_shard(tmp_path):
    """40 shards of 10 tokens (shard k holds 1000 + 10k .. 1000 + 10k + 9). Only shard 37's file
    exists: reading a row inside shard 37 must not touch any other shard."""
    refs = []
    for k in range(40):
        if k == 37:
            refs.append(write_shard(tmp_path, "web", f"web-{k:03d}", [list(range(1000 + 10 * k, 1010 + 10 * k))]))
        else:
            refs.append(ShardRef(f"web-{k:03d}", "web", "train", str(tmp_path / "missing" / f"{k}.arrow"), 1, 10))
    stream = SourceStream("web", refs, seed=0)
    b = Batcher([LMRows(stream, 4)], [1.0])
    batch = b.batch(range(93, 94))  # reads stream [372, 377) = shard 37 tokens [2, 7)
    assert batch.inputs[0].tolist() == [1372, 1373, 1374, 1375]
    assert batch.targets[0].tolist() == [1373, 1374, 1375, 1376]
    assert list(stream._open) == ["web-037"]
    assert [(p.shard_id, p.tok_start, p.tok_end) for p in batch.pieces] == [("web-037", 2, 6)]


def test_seek_into_a_late_epoch_opens_one_shard_and_one_epoch_order(tmp_path):
    refs = [
        write_shard(tmp_path, "web", f"web-{k:03d}", [list(range(1000 + 10 * k, 1010 + 10 * k))]) for k in range(40)
    ]
    stream = SourceStream("web", refs, seed=0)
    b = Batcher([LMRows(stream, 4)], [1.0])
    g = 5 * 100 + 93  # 100 rows per 400-token epoch: epoch 5, offset 372
    batch = b.batch(range(g, g + 1))
    assert len(stream._open) == 1
    assert set(stream._orders) == {5}
    (p,) = batch.pieces
    assert p.epoch == 5 and (p.tok_start, p.tok_end) == (2, 6)
    k = int(p.shard_id.split("-")[1])
    assert batch.inputs[0].tolist() == [1002 + 10 * k + i for i in range(4)]


def test_shard_size_mismatch_with_ledger_is_an_error(tmp_path):
    ref = write_shard(tmp_path, "web", "web-000", [list(range(10))])
    bad = ShardRef(ref.shard_id, ref.source, ref.split, ref.path, ref.docs, tokens=11)
    with pytest.raises(GhostvisError, match="10 tokens on disk, ledger says 11"):
        SourceStream("web", [bad], 0).read(0, 5)


# ---------------------------------------------------------------- SFT packing (hand-built chat shard)


def test_token_shard_doc_list_reads_a_parallel_list_column(tmp_path):
    mask_col = list_column([2, 3], [0, 1, 0, 0, 1], np.uint8)
    ref = write_shard(tmp_path, "chat", "chat-000", [[1, 2], [3, 4, 5]], extra={"mask": mask_col})
    shard = TokenShard.open(Path(ref.path))
    assert shard.doc_list("mask", 0).tolist() == [0, 1]
    assert shard.doc_list("mask", 1).tolist() == [0, 0, 1]


def test_chat_rows_counts(tmp_path):
    # Three conversations, seq_len 8: lengths 5, 5, 11 -> each needs its own row in any order
    # (5+5 > 8, 5+8 > 8). Loss mask 0 on the first two (prompt) tokens / first three for the long one.
    docs = [list(range(10, 15)), list(range(20, 25)), list(range(30, 41))]
    masks = [[0, 0, 1, 1, 1], [0, 0, 1, 1, 1], [0, 0, 0] + [1] * 8]
    mask_col = list_column([5, 5, 11], [m for mm in masks for m in mm], np.uint8)
    ref = write_shard(tmp_path, "chat", "chat-000", docs, extra={"mask": mask_col})
    rows = ChatRows(SourceStream("chat", [ref], 0), seq_len=8, seed=0, pad_id=0)
    batch = Batcher([rows], [1.0]).batch(range(0, 3))
    # real: 5 + 5 + 8 (the long one is cut at 8); pad: 3 + 3 + 0; cropped: 11 - 8 = 3
    # loss: a target at position i is token i+1 when mask[i+1], inside the row: 3 + 3 + (mask[1:8] has 5
    # ones); the cut-off token 38 is cropped, so it is not a target either
    assert batch.counts.as_list() == [18, 6, 11, 3]
    assert int((batch.targets != IGNORE_INDEX).sum()) == 11
    by_first = {int(batch.inputs[i, 0]): i for i in range(3)}
    i = by_first[10]
    assert batch.inputs[i].tolist() == [10, 11, 12, 13, 14, 0, 0, 0]
    assert batch.targets[i].tolist() == [-1, 12, 13, 14, -1, -1, -1, -1]
    assert batch.doc_ids[i].tolist() == [0, 0, 0, 0, 0, -1, -1, -1]
    i = by_first[30]
    assert batch.inputs[i].tolist() == list(range(30, 38))
    assert batch.targets[i].tolist() == [-1, -1, 33, 34, 35, 36, 37, -1]  # 38 is cut: cropped, not a target
    # pieces are whole conversations: what was read = trained + cropped
    assert sum(p.tokens for p in batch.pieces) == batch.counts.real_tokens + batch.counts.cropped_tokens == 21


@pytest.mark.parametrize("seed", [0, 4])
def test_chat_rows_read_every_conversation_once_per_epoch(tmp_path, seed):
    lens = [4, 4, 5, 3]
    docs, nxt = [], 10
    for n in lens:
        docs.append(list(range(nxt, nxt + n)))
        nxt += n
    ref = write_shard(tmp_path, "chat", "chat-000", docs)  # no mask column: loss on every target
    rows = ChatRows(SourceStream("chat", [ref], seed), seq_len=8, seed=seed, pad_id=0)
    by_epoch: dict[int, list[tuple[int, int]]] = {}
    for j in range(12):
        for p in rows.row(j).pieces:
            by_epoch.setdefault(p.epoch, []).append((p.tok_start, p.tok_end))
    spans = sorted([(0, 4), (4, 8), (8, 13), (13, 16)])
    complete = [e for e in by_epoch if e < max(by_epoch)]
    assert len(complete) >= 2
    for e in complete:
        assert sorted(by_epoch[e]) == spans, f"epoch {e}"

"""Typed ledger rows the tests build by hand (ghostvis_core/data/ledger/records.py): a shard record, a
part row, a piece read in it, and `write`, the part and its pieces through `Ledger.write_part`."""

from __future__ import annotations

from ghostvis_core.counts import TokenCounts
from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.ledger.records import ConsumptionRow, PartRow, ShardRecord
from ghostvis_core.data.shard_piece import Piece

# a shard record's fields but for its id, content and tokens, unless a test gives them
SHARD = {"source": "prose", "split": "train", "kind": "text", "tokenizer_id": "tok-a", "docs": 10, "raw_bytes": 1000,
         "token_path": "", "created_at": 1.0}  # fmt: skip


def shard_record(shard_id, *, tokens=100, sha="sha-1", **given) -> ShardRecord:
    """A registered shard (what `Ledger.shards` returns, or what `Ledger.write_shard` takes): `given`
    overrides SHARD's fields; the text is 4 bytes a token."""
    return ShardRecord(
        shard_id=shard_id, content_sha256=sha, tokens=tokens, text_bytes=4 * tokens, **{**SHARD, **given}
    )


# a part row's fields but for its ids, steps, rows and figures, unless a test gives them: the batch is
# 2 x 4 x 2 ranks x 2 micro-batches
PART = {"stage": "pretrain", "segment": 0, "micro_batch_size": 2, "seq_len": 4, "world_size": 2, "grad_accum_steps": 2,
        "tokens_per_step": 32, "planned_tokens": 960, "created_at": 1.0}  # fmt: skip


def part(part_id, run_key, *, steps=(1, 10), rows=(0, 80), prev="", parent="", real=0, pad=0, loss=0, cropped=0,
         overlap=0, replay="[]", **given) -> PartRow:  # fmt: skip
    """A part of run `run_key` (its steps, rows and four figures); `given` overrides PART's fields."""
    return PartRow(
        part_id=part_id,
        prev_part_id=prev,
        run_key=run_key,
        parent_run_key=parent,
        step_first=steps[0],
        step_last=steps[1],
        rows_first=rows[0],
        rows_last=rows[1],
        overlap_tokens=overlap,
        replay_sources=replay,
        **TokenCounts(real, pad, loss, cropped).as_dict(),
        **{**PART, **given},
    )


def piece(shard_id, tok, rows, *, source="prose", split="train", epoch=0) -> tuple[Piece, tuple[int, int]]:
    """Tokens `tok` of a shard read in `epoch`, spanning raw `rows`: a consumption row once its part is known."""
    return Piece(source, shard_id, split, epoch, *tok), rows


def consumption(part: PartRow, pieces: list[tuple[Piece, tuple[int, int]]]) -> list[ConsumptionRow]:
    """The part's consumption rows of its `piece`s."""
    return [ConsumptionRow.of(part, p, rows) for p, rows in pieces]


def write(ledger: Ledger, part: PartRow, pieces: list[tuple[Piece, tuple[int, int]]], **beside) -> None:
    """`Ledger.write_part` of the part and its `piece`s (and the tables `beside` it)."""
    ledger.write_part(part, consumption(part, pieces), **beside)

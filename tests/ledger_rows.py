"""Typed ledger rows the tests build by hand (ghostvis_core/data/ledger/records.py): a shard record, a
part row, a piece read in it, and `write`, the part and its pieces through `Ledger.write_part`."""

from __future__ import annotations

from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.ledger.records import ConsumptionRow, PartRow, ShardRecord
from ghostvis_core.data.piece import Piece


def shard_record(
    shard_id,
    *,
    source="prose",
    split="train",
    kind="text",
    tokenizer_id="tok-a",
    tokens=100,
    docs=10,
    sha="sha-1",
    created_at=1.0,
    token_path="",
) -> ShardRecord:
    """A registered shard (what `Ledger.shards` returns, or what `Ledger.write_shard` takes)."""
    return ShardRecord(
        shard_id=shard_id,
        source=source,
        split=split,
        kind=kind,
        content_sha256=sha,
        raw_bytes=1000,
        tokenizer_id=tokenizer_id,
        docs=docs,
        tokens=tokens,
        text_bytes=4 * tokens,
        token_path=token_path,
        created_at=created_at,
    )


def part(
    part_id,
    run_key,
    *,
    segment=0,
    steps=(1, 10),
    rows=(0, 80),
    prev="",
    parent="",
    stage="pretrain",
    real=0,
    pad=0,
    loss=0,
    cropped=0,
    overlap=0,
    created_at=1.0,
    allow_repeat=False,
    replay="[]",
    passed_over="[]",
) -> PartRow:
    """A part of run `run_key` (steps, rows, the four figures); the batch is 2 x 4 x 2 ranks x 2 micro-batches."""
    return PartRow(
        part_id=part_id,
        prev_part_id=prev,
        run_key=run_key,
        parent_run_key=parent,
        stage=stage,
        segment=segment,
        step_first=steps[0],
        step_last=steps[1],
        rows_first=rows[0],
        rows_last=rows[1],
        real_tokens=real,
        pad_tokens=pad,
        loss_tokens=loss,
        cropped_tokens=cropped,
        overlap_tokens=overlap,
        micro_batch_size=2,
        seq_len=4,
        world_size=2,
        grad_accum_steps=2,
        tokens_per_step=32,
        planned_tokens=960,
        allow_repeat=allow_repeat,
        replay_sources=replay,
        passed_over=passed_over,
        mlflow_run_id="",
        created_at=created_at,
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

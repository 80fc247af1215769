"""Typed ledger rows for the tests that need one without writing a ledger (ghostvis_core/data/ledger/records.py)."""

from __future__ import annotations

from ghostvis_core.data.ledger.records import ShardRecord


def shard_record(source: str, kind: str, split: str, tokens: int) -> ShardRecord:
    """A registered shard of `source` (what `Ledger.shards` returns), named after its source and split."""
    return ShardRecord(
        shard_id=f"{source}/{split}",
        source=source,
        split=split,
        kind=kind,
        content_sha256="sha",
        replaces_sha256="",
        raw_bytes=0,
        tokenizer_id="tok",
        docs=1,
        tokens=tokens,
        text_bytes=0,
        docs_dropped=0,
        tokens_dropped=0,
        drop_reasons="{}",
        token_path="",
        token_sha256="",
        created_at=0.0,
    )

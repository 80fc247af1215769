"""The raw columns each kind of source has, and the check of a downloaded shard against them.

One owner for what a source kind is: `KIND_COLUMNS` names the columns the tokenizer reads (the first is
the text a document filter looks at), `SOURCE_KINDS` the kinds a source may declare. `check_shard_schema`
runs on every download, before the file takes its place in the store, so a shard whose columns are
missing, of another type, or not valid UTF-8 is refused naming the shard, column and row, rather
than failing inside tokenization with a Python exception.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ghostvis_core.errors import GhostvisError

KIND_COLUMNS = {
    "text": ["text"],
    "chat": ["messages", "image"],
    "preference": ["prompt", "chosen", "rejected"],
    "image_caption": ["caption", "image"],
}
SOURCE_KINDS = tuple(KIND_COLUMNS)
OPTIONAL_COLUMNS = {("chat", "image")}  # a chat without images has no image column


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_bytes(t: pa.DataType) -> bool:
    return pa.types.is_binary(t) or pa.types.is_large_binary(t)


def _is_messages(t: pa.DataType) -> bool:
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)) or not pa.types.is_struct(t.value_type):
        return False
    fields = {f.name: f.type for f in t.value_type}
    return all(_is_text(fields.get(k, pa.null())) for k in ("role", "content"))


# column -> (its test, the type it names in messages)
COLUMN_TYPES: dict[str, tuple[Callable[[pa.DataType], bool], str]] = {
    "text": (_is_text, "string"),
    "prompt": (_is_text, "string"),
    "chosen": (_is_text, "string"),
    "rejected": (_is_text, "string"),
    "caption": (_is_text, "string"),
    "image": (_is_bytes, "binary (encoded image bytes)"),
    "messages": (_is_messages, "list<struct<role: string, content: string>>"),
}


def check_kind(source: str, kind: str) -> None:
    if kind not in SOURCE_KINDS:
        raise GhostvisError(f"source {source}: unknown kind {kind!r}; set kind to one of {', '.join(SOURCE_KINDS)}")


def check_shard_schema(shard_id: str, kind: str, path: Path) -> None:
    """Refuse a shard file that is not Parquet, lacks a column its kind needs, holds one of another
    type, or has a text value that is not UTF-8 (naming the first bad row)."""
    fix = f"fix the file or the source's kind ({kind}), then re-materialize raw_shards partition {shard_id}"
    try:
        pf = pq.ParquetFile(path)
        schema = pf.schema_arrow
    except Exception as exc:  # pyarrow raises several types for a file that is not Parquet
        raise GhostvisError(f"shard {shard_id}: not a readable Parquet file ({exc}); {fix}") from None
    for column in KIND_COLUMNS[kind]:
        if column not in schema.names:
            if (kind, column) in OPTIONAL_COLUMNS:
                continue
            raise GhostvisError(
                f"shard {shard_id}: no column {column!r}, which a {kind} source needs "
                f"(columns: {', '.join(schema.names)}); {fix}"
            )
        ok, wanted = COLUMN_TYPES[column]
        got = schema.field(column).type
        if not ok(got):
            raise GhostvisError(f"shard {shard_id}: column {column!r} is {got}, expected {wanted}; {fix}")
        if _is_text(got):
            _check_utf8(shard_id, pf, column, fix)


def _check_utf8(shard_id: str, pf: pq.ParquetFile, column: str, fix: str) -> None:
    """Parquet does not validate string bytes when it writes them, nor when it reads them: check each batch,
    and find the first bad row of a batch that fails."""
    row = 0
    for batch in pf.iter_batches(columns=[column]):
        values = batch.column(0)
        try:
            values.validate(full=True)
        except pa.ArrowInvalid:
            raw = values.cast(pa.large_binary()).to_pylist()
            bad = next(i for i, v in enumerate(raw) if v is not None and not _utf8(v))
            raise GhostvisError(
                f"shard {shard_id}: row {row + bad}, column {column!r} is not valid UTF-8 text; {fix}"
            ) from None
        row += len(batch)


def _utf8(value: bytes) -> bool:
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True

"""The raw columns each kind of source has, and the check of a downloaded shard against them.

One owner for what a source kind is: `KIND_COLUMNS` names the columns the tokenizer reads (the first is
the text a document filter looks at), `SOURCE_KINDS` the kinds a source may declare. `check_shard_schema`
runs on every raw shard, before it takes its place in the store (after ghostvis_core/data/normalize_shard.py put a
user's file in its kind's shape) and before it is tokenized, so a shard whose columns are missing, of
another type, or not valid UTF-8 is refused naming the shard, column and row, rather than failing inside
tokenization with a Python exception.
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
    "problem": ["prompt", "answer"],  # the rl stage's: a prompt and the answer its reward rule checks
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


def _is_text_or_messages(t: pa.DataType) -> bool:
    return _is_text(t) or _is_messages(t)


MESSAGES_TYPE = "list<struct<role: string, content: string>>"
# column -> (its test, the type it names in messages)
COLUMN_TYPES: dict[str, tuple[Callable[[pa.DataType], bool], str]] = {
    "text": (_is_text, "string"),
    "prompt": (_is_text_or_messages, f"string or {MESSAGES_TYPE}"),
    "chosen": (_is_text_or_messages, f"string or {MESSAGES_TYPE}"),
    "rejected": (_is_text_or_messages, f"string or {MESSAGES_TYPE}"),
    "answer": (_is_text, "string"),
    "caption": (_is_text, "string"),
    "image": (_is_bytes, "binary (encoded image bytes)"),
    "messages": (_is_messages, MESSAGES_TYPE),
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
    mismatch = schema_mismatch(kind, schema)
    if mismatch:
        raise GhostvisError(f"shard {shard_id}: {mismatch}; {fix}")
    for column in KIND_COLUMNS[kind]:
        if column in schema.names and _is_text(schema.field(column).type):
            _check_utf8(shard_id, pf, column, fix)


def schema_mismatch(kind: str, schema: pa.Schema) -> str | None:
    """What makes a Parquet schema other than the kind's (a missing column, one of another type), or None."""
    for column in KIND_COLUMNS[kind]:
        if column not in schema.names:
            if (kind, column) in OPTIONAL_COLUMNS:
                continue
            return f"no column {column!r}, which a {kind} source needs (columns: {', '.join(schema.names)})"
        ok, wanted = COLUMN_TYPES[column]
        got = schema.field(column).type
        if not ok(got):
            return f"column {column!r} is {got}, expected {wanted}"
    return None


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

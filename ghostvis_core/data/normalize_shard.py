"""A user's shard file, as downloaded, into the raw shard GhostVis reads: its kind's columns in Parquet.

Users have their data in JSON Lines or Parquet, with their own column names (`conversations` for
`messages`), preference replies as strings or as message lists (TRL's two shapes), images as bytes or as
paths beside the file. `normalize_shard` runs on every download, before the file takes its place in the
store: it reads the file (Parquet by its magic bytes, anything else as JSON Lines), reads each of the
kind's fields from the column the source's `columns` mapping names, checks every row (naming the shard,
the row and the field), fetches images named by a relative path through the shard's own transport, and
writes the kind's Parquet (`schema.KIND_COLUMNS`, the types of `schema.COLUMN_TYPES`) in place of the
download. A Parquet file already in that shape is kept byte for byte, so its sha256 stays the one its
publisher lists; a converted shard's content is the Parquet written, and raw_shards records that sha256.
"""

from __future__ import annotations

import io
import json
import urllib.parse
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ghostvis_core.data.chat import ROLES
from ghostvis_core.data.schema import KIND_COLUMNS, OPTIONAL_COLUMNS, check_shard_schema, schema_mismatch
from ghostvis_core.data.shard_manifest import fetch_many
from ghostvis_core.errors import GhostvisError

MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
SHAPES = {  # field -> what a row may hold there, as messages name it
    "text": "a string",
    "caption": "a string",
    "answer": "a string or an integer",
    "messages": "a list of {role, content} messages",
    "prompt": "a string or a list of {role, content} messages",
    "chosen": "a string or a list of {role, content} messages",
    "rejected": "a string or a list of {role, content} messages",
    "image": "image bytes, or a path relative to the shard's file",
}


class RowError(Exception):
    """One field of one row is wrong: `field` (dotted into a message) and what is wrong with it."""

    def __init__(self, field: str, problem: str):
        super().__init__(problem)
        self.field, self.problem = field, problem


def is_parquet(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"PAR1"


def check_columns_mapping(source: str, kind: str, columns: dict[str, str]) -> None:
    """A mapping renames only the kind's own fields, each to a column name (checked at shard_manifest)."""
    for field, column in columns.items():
        if field not in KIND_COLUMNS[kind] or not isinstance(column, str) or not column:
            raise GhostvisError(
                f"source {source}: columns mapping {field!r}: {column!r} does not map a field of a {kind} source "
                f"to a column name; map each of {', '.join(KIND_COLUMNS[kind])} to the name your files use, "
                f"e.g. columns: {{{KIND_COLUMNS[kind][0]}: my_column}}"
            )


def normalize_shard(shard_id: str, kind: str, columns: dict[str, str], url: str, path: Path) -> bool:
    """Check the downloaded file at `path` row by row and rewrite it as the kind's Parquet when it is in
    another format or shape; True when it was rewritten (its content, hence its sha256, changed)."""
    fix = (
        f"fix the row, or the source's kind ({kind}) or its columns mapping, then re-materialize raw_shards "
        f"partition {shard_id}"
    )
    parquet = is_parquet(path)
    if parquet and not columns and schema_mismatch(kind, _schema(shard_id, path, fix)) is None:
        check_shard_schema(shard_id, kind, path)  # the types are the kind's: check the strings' UTF-8
        if kind != "text":  # a text row is a string or null (an empty document, dropped and counted)
            _check_rows(shard_id, kind, _rows(shard_id, path, parquet, fix), {}, url, fix)
        return False
    table = _check_rows(shard_id, kind, _rows(shard_id, path, parquet, fix), columns, url, fix)
    pq.write_table(table, path)
    return True


def _schema(shard_id: str, path: Path, fix: str) -> pa.Schema:
    try:
        return pq.read_schema(path)
    except Exception as exc:  # pyarrow raises several types for a file that is not Parquet
        raise GhostvisError(f"shard {shard_id}: not a readable Parquet file ({exc}); {fix}") from None


def _rows(shard_id: str, path: Path, parquet: bool, fix: str) -> list[dict]:
    """The file's rows, as dicts of its own column names."""
    if parquet:
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as exc:  # pyarrow raises several types for a corrupt file or invalid UTF-8
            raise GhostvisError(f"shard {shard_id}: not a readable Parquet file ({exc}); {fix}") from None
    else:
        rows = []
        with open(path, "rb") as f:
            for i, line in enumerate(f):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as exc:
                    raise GhostvisError(
                        f"shard {shard_id}: line {i + 1} is not a JSON object ({exc}); a shard is a Parquet file "
                        f"or JSON Lines (one object a line); {fix}"
                    ) from None
                if not isinstance(row, dict):
                    raise GhostvisError(
                        f"shard {shard_id}: line {i + 1} is a JSON {type(row).__name__}, expected an object; {fix}"
                    )
                rows.append(row)
    return rows


def _check_rows(shard_id: str, kind: str, rows: list[dict], columns: dict[str, str], url: str, fix: str) -> pa.Table:
    """Every row's fields, each read from its column (`columns` maps the renamed ones), checked and put in the
    kind's shape; the first bad one refused by shard, row and field."""
    fields = KIND_COLUMNS[kind]
    out: dict[str, list] = {f: [] for f in fields}
    first: dict[str, str] = {}  # field -> row 0's shape (string | message list): one shape per file
    images = fetch_many([sibling_url(url, p) for p in _image_paths(rows, columns)]) if "image" in fields else {}
    for r, row in enumerate(rows):
        try:
            for field in fields:
                value = row.get(columns.get(field, field))
                if value is None and (kind, field) in OPTIONAL_COLUMNS:
                    out[field].append(None)
                    continue
                if value is None:
                    keys = ", ".join(sorted(str(k) for k, v in row.items() if v is not None)) or "none"
                    raise RowError(field, f"is missing (the row's columns: {keys}); expected {SHAPES[field]}")
                out[field].append(_value(field, value, url, first, images))
        except RowError as e:
            top = e.field.split("[")[0]  # messages[1].role is in the column of messages
            column = f" (column {columns[top]!r})" if top in columns else ""
            raise GhostvisError(f"shard {shard_id}: row {r}, field {e.field!r}{column} {e.problem}; {fix}") from None
    types = {f: MESSAGES if first.get(f) == "message list" else _ARROW[f] for f in fields}
    keep = [f for f in fields if (kind, f) not in OPTIONAL_COLUMNS or any(v is not None for v in out[f])]
    return pa.table({f: pa.array(out[f], types[f]) for f in keep})


_ARROW = {
    "text": pa.string(),
    "caption": pa.string(),
    "answer": pa.string(),
    "prompt": pa.string(),
    "chosen": pa.string(),
    "rejected": pa.string(),
    "messages": MESSAGES,
    "image": pa.binary(),
}


def _value(field: str, value, url: str, first: dict[str, str], images: dict[str, bytes | GhostvisError]):
    if field == "image":
        return _image(value, url, images)
    if field == "answer":
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise RowError(field, f"is {_type(value)}, expected {SHAPES[field]}")
        return str(value)
    if field == "messages" or (field in ("prompt", "chosen", "rejected") and isinstance(value, list)):
        shape = "message list"
        value = _messages(field, value)
        if field in ("chosen", "rejected") and value[0]["role"] != "assistant":
            raise RowError(
                f"{field}[0].role",
                f"is {value[0]['role']!r}, expected 'assistant': a reply's messages follow the prompt, which is "
                f"the prompt column (TRL's conversational shape with an explicit prompt)",
            )
    elif isinstance(value, str):
        shape = "string"
    else:
        raise RowError(field, f"is {_type(value)}, expected {SHAPES[field]}")
    if first.setdefault(field, shape) != shape:
        raise RowError(field, f"is a {shape}, but row 0's is a {first[field]}: one shape per file")
    return value


def _messages(field: str, value) -> list[dict]:
    """A list of {role, content}: role one of the chat template's, content a string (other keys dropped)."""
    if not isinstance(value, list) or not value:
        raise RowError(field, f"is {_type(value)}, expected a non-empty list of {{role, content}} messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise RowError(f"{field}[{i}]", f"is {_type(m)}, expected a {{role, content}} object")
        if m.get("role") not in ROLES:
            raise RowError(f"{field}[{i}].role", f"is {m.get('role')!r}, expected one of {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise RowError(
                f"{field}[{i}].content",
                f"is {_type(m.get('content'))}, expected a string (content parts: join their text, with "
                f"<|image|> where an image goes)",
            )
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _image_paths(rows: list[dict], columns: dict[str, str]) -> list[str]:
    """The relative paths the rows' images are given as, to fetch them all at once before the rows are checked."""
    values = [row.get(columns.get("image", "image")) for row in rows]
    values = [(v.get("bytes") or v.get("path")) if isinstance(v, dict) else v for v in values]
    return [v for v in values if isinstance(v, str) and _relative(v)]


def _relative(value: str) -> bool:
    ref = Path(value)
    return bool(value) and not ref.is_absolute() and ".." not in ref.parts and "://" not in value


def _image(value, url: str, images: dict[str, bytes | GhostvisError]) -> bytes:
    """Image bytes as given (a Hugging Face Image column holds {bytes, path}), or the file a relative path names
    (fetched beforehand, `images`)."""
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    if isinstance(value, (bytes, bytearray)) and value:
        return _decodable(bytes(value), "holds")
    if not isinstance(value, str) or not value:
        raise RowError("image", f"is {_type(value)}, expected {SHAPES['image']}")
    if not _relative(value):
        raise RowError("image", f"is {value!r}, expected a path relative to the shard's file, inside its folder")
    blob = images[sibling_url(url, value)]
    if isinstance(blob, GhostvisError):
        raise RowError("image", f"names {value!r}, which cannot be read ({str(blob).split(';')[0]})")
    return _decodable(blob, f"names {value!r}, which holds")


def _decodable(blob: bytes, what: str) -> bytes:
    """Image bytes the vision encoder can decode (PIL reads the header: PNG, JPEG, WebP, ...), else refused
    here rather than when a stage's first batch decodes them."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(blob)) as img:
            img.verify()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise RowError(
            "image",
            f"{what} {len(blob)} bytes that are not an image ({type(exc).__name__}); expected PNG, JPEG or "
            "another format PIL reads",
        ) from None
    return blob


def sibling_url(url: str, ref: str) -> str:
    """The URL of `ref`, a relative path, beside the file at `url` (s3 keys are raw, other URLs quoted)."""
    base = url.rsplit("/", 1)[0]
    return f"{base}/{ref if url.startswith('s3://') else urllib.parse.quote(ref)}"


def _type(value) -> str:
    name = type(value).__name__
    return "missing" if value is None else f"{'an' if name[0] in 'aeiou' else 'a'} {name} ({_short(value)})"


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."

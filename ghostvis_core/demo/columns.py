"""The demo sources' columns: one type per column name, whichever demo source has it, so a source's
schema is the list of its column names (in the order its Parquet shards hold them)."""

from __future__ import annotations

import pyarrow as pa

MESSAGE_TYPE = pa.struct([("role", pa.string()), ("content", pa.string())])
_TYPES = {
    "language_score": pa.float64(),  # the text sources' FineWeb-like metadata
    "token_count": pa.int64(),
    "count": pa.int64(),  # demo_images: how many shapes the image shows
    "image": pa.binary(),
    "messages": pa.list_(MESSAGE_TYPE),
}


def demo_schema(*columns: str) -> pa.Schema:
    """A demo source's schema from its column names: every column a string but those _TYPES names."""
    return pa.schema([(name, _TYPES.get(name, pa.string())) for name in columns])

"""Token shards: one Arrow IPC file per raw shard, memory-mapped by the loader.

Schema: `row` (int64, the document's row in the raw Parquet shard) and `tokens` (large_list of
uint16/uint32: <|bos|> followed by the document's tokens). Written as a single record batch, so the
loader gets the flat token array and the document offsets without copying.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from ghostvis_core.errors import GhostvisError


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32


def write_token_shard(path: Path, rows: np.ndarray, offsets: np.ndarray, values: np.ndarray) -> None:
    """Write atomically: a reader never sees a half-written shard under the final name."""
    tokens = pa.LargeListArray.from_arrays(pa.array(offsets, pa.int64()), pa.array(values))
    table = pa.table({"row": pa.array(rows, pa.int64()), "tokens": tokens})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=len(rows) or 1)
    os.replace(tmp, path)


@dataclass
class TokenShard:
    """A memory-mapped token shard: flat `values`, per-document `offsets` (docs+1) and raw `rows`."""

    path: Path
    values: np.ndarray
    offsets: np.ndarray
    rows: np.ndarray

    @classmethod
    def open(cls, path: Path, shard_id: str = "") -> "TokenShard":
        name = shard_id or str(path)
        if not path.exists():
            raise GhostvisError(
                f"token shard {name}: file {path} is missing; re-materialize tokenized_shards "
                f"partition {shard_id or '<shard>'}"
            )
        try:
            reader = pa.ipc.open_file(pa.memory_map(str(path), "r"))
            table = reader.read_all()
            col = table.column("tokens")
            if col.num_chunks != 1:
                col = pa.chunked_array([col.combine_chunks()])
            arr = col.chunk(0)
            offsets = arr.offsets.to_numpy()
            values = arr.values.to_numpy(zero_copy_only=True)
            rows = table.column("row").to_numpy()
        except (pa.ArrowInvalid, pa.ArrowTypeError, OSError, KeyError) as exc:
            raise GhostvisError(
                f"token shard {name}: cannot read {path} ({exc}); delete it and re-materialize "
                f"tokenized_shards partition {shard_id or '<shard>'}"
            ) from None
        return cls(path, values, offsets, rows)

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1] - self.offsets[0])

    def slice(self, start: int, end: int) -> np.ndarray:
        """Tokens [start, end) in shard-local token coordinates."""
        base = self.offsets[0]
        return self.values[base + start : base + end]

    def rows_of(self, start: int, end: int) -> tuple[int, int]:
        """Raw rows [first, last) whose documents hold any of the tokens [start, end)."""
        base = self.offsets[0]
        first = int(np.searchsorted(self.offsets, base + start, side="right")) - 1
        last = int(np.searchsorted(self.offsets, base + end, side="left"))
        return int(self.rows[first]), int(self.rows[last - 1]) + 1

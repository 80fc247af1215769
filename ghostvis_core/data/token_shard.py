"""Token shards: one Arrow IPC file per raw shard, memory-mapped by the loader.

Every kind of source has a `row` column (the document's row in the raw Parquet shard) and a
`tokens` column (large_list of uint16/uint32) holding all of the document's tokens:
- text: <|bos|> + the text's tokens
- chat: the rendered conversation, plus `mask` (same lengths, 1 = carries loss)
- preference: prompt ++ chosen ++ rejected, plus `prompt_len` and `chosen_len`
- problem: the chat prompt ++ the answer as its reply, plus `prompt_len`
- image_caption: <|bos|><|image|> + caption + <|eot|>, plus `image` (encoded bytes)
Written as a single record batch, so `tokens` gives the flat token array and the document offsets
without copying; consumption is recorded in these shard-local token coordinates. The schema metadata
names the tokenizer that wrote the file (TOKENIZER_KEY) and holds the digest of each block of its tokens
(token_blocks.py), which every read through `slice` checks the first time it touches a block.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from ghostvis_core.data.token_blocks import BLOCKS_KEY, BlockCheck, TokenBlocks
from ghostvis_core.errors import GhostvisError
from ghostvis_core.store.files import replacing

TOKENIZER_KEY = "ghostvis.tokenizer_id"  # schema metadata: the id of the tokenizer that wrote the file


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32


def list_column(lengths: list[int], flat: list[int], dtype) -> pa.Array:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(np.asarray(flat, dtype=dtype)))


def numpy_view(array: pa.Array) -> np.ndarray:
    """A read-only numpy view of an integer Arrow array without nulls (every numeric column of a token
    shard). Not `to_numpy`: pyarrow imports pandas on its first conversion, on every rank before
    its first optimizer step."""
    dtype, data = np.dtype(str(array.type)), array.buffers()[1]
    if data is None:  # an empty array has no data buffer
        return np.empty(0, dtype)
    return np.frombuffer(data, dtype=dtype)[array.offset : array.offset + len(array)]


def write_token_shard(path: Path, columns: dict[str, pa.Array], tokenizer_id: str | None = None) -> None:
    """Write atomically: a reader never sees a half-written shard under the final name. The tokenizer
    that made the tokens is named in the file's schema metadata (TOKENIZER_KEY), so the audit can prove
    a file was made by the tokenizer its path and ledger record claim (token_integrity.py). The digests of
    its token blocks go there too, for the readers to check (token_blocks.py)."""
    table = pa.table(columns)
    tokens = table.column("tokens").combine_chunks()
    offsets = numpy_view(tokens.offsets)
    metadata = {BLOCKS_KEY: TokenBlocks.of(numpy_view(tokens.values)[offsets[0] : offsets[-1]]).to_metadata()}
    if tokenizer_id is not None:
        metadata[TOKENIZER_KEY] = tokenizer_id
    table = table.replace_schema_metadata(metadata)
    with replacing(path) as tmp, pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=max(1, table.num_rows))


@dataclass
class TokenShard:
    """A memory-mapped token shard: flat `values`, per-document `offsets` (docs+1), raw `rows`,
    and the kind-specific columns (`extra`), all zero-copy where Arrow allows. `blocks` checks the
    file's token blocks against their digests as `slice` first reads them."""

    path: Path
    values: np.ndarray
    offsets: np.ndarray
    rows: np.ndarray
    blocks: BlockCheck
    extra: dict[str, pa.Array] = field(default_factory=dict)

    @classmethod
    def open(cls, path: Path, shard_id: str = "") -> TokenShard:
        name = shard_id or str(path)
        if not path.exists():
            raise GhostvisError(
                f"token shard {name}: file {path} is missing; re-materialize tokenized_shards "
                f"partition {shard_id or '<shard>'}"
            )
        try:
            table = pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all().combine_chunks()
            arr = table.column("tokens").chunk(0)
            offsets = numpy_view(arr.offsets)
            values = numpy_view(arr.values)
            rows = numpy_view(table.column("row").chunk(0))
            extra = {n: table.column(n).chunk(0) for n in table.column_names if n not in ("row", "tokens")}
            blocks = BlockCheck(name, path, TokenBlocks.from_metadata(table.schema.metadata))
        except (pa.ArrowInvalid, pa.ArrowTypeError, OSError, KeyError, IndexError, ValueError) as exc:
            raise GhostvisError(
                f"token shard {name}: cannot read {path} ({exc}); delete it and re-materialize "
                f"tokenized_shards partition {shard_id or '<shard>'}"
            ) from None
        return cls(path, values, offsets, rows, blocks, extra)

    @property
    def num_docs(self) -> int:
        return len(self.rows)

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1] - self.offsets[0])

    def slice(self, start: int, end: int) -> np.ndarray:
        """Tokens [start, end) in shard-local token coordinates, their blocks checked against their digests."""
        base = self.offsets[0]
        self.blocks.cover(self.values[base : self.offsets[-1]], start, end)
        return self.values[base + start : base + end]

    def doc_span(self, i: int) -> tuple[int, int]:
        """Document i's tokens as [start, end) in shard-local token coordinates."""
        base = self.offsets[0]
        return int(self.offsets[i] - base), int(self.offsets[i + 1] - base)

    def doc_tokens(self, i: int) -> np.ndarray:
        return self.slice(*self.doc_span(i))

    def doc_list(self, column: str, i: int) -> np.ndarray:
        """Document i's entry of a list column that parallels `tokens` (e.g. the chat `mask`)."""
        arr = self.extra[column]
        offsets = numpy_view(arr.offsets)
        return numpy_view(arr.values)[offsets[i] : offsets[i + 1]]

    def doc_value(self, column: str, i: int):
        return self.extra[column][i].as_py()

    def rows_of(self, start: int, end: int) -> tuple[int, int]:
        """Raw rows [first, last) whose documents hold any of the tokens [start, end)."""
        base = self.offsets[0]
        first = int(np.searchsorted(self.offsets, base + start, side="right")) - 1
        last = int(np.searchsorted(self.offsets, base + end, side="left"))
        return int(self.rows[first]), int(self.rows[last - 1]) + 1

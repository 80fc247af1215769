"""The audit's own reader of token files (Arrow IPC, one per tokenized shard; the format is described
in docs/glossary.md "token file"). It shares no code with the trainer's reader, so a bug there cannot
make the trainer and the audit agree on wrong tokens.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from ghostvis_core.errors import GhostvisError


def _ints(array: pa.Array) -> np.ndarray:
    """An integer Arrow array without nulls as int64, from its data buffer: pyarrow's own conversion
    imports pandas on first use, which would be most of a `ghostvis trace` answer."""
    data = array.buffers()[1]
    if data is None:  # an empty array has no data buffer
        return np.empty(0, np.int64)
    values = np.frombuffer(data, dtype=np.dtype(str(array.type)))
    return values[array.offset : array.offset + len(array)].astype(np.int64)


class TokenFile:
    """One token file read whole: the flat tokens, document starts (shard-local, docs + 1 entries),
    the raw rows, and per document its chat mask, image, preference lengths where the kind has them."""

    def __init__(self, path: Path, shard_id: str):
        try:
            with pa.memory_map(str(path), "r") as source:
                table = pa.ipc.open_file(source).read_all()
        except (OSError, pa.ArrowInvalid) as exc:
            raise GhostvisError(
                f"token file of {shard_id} ({path}): not readable ({exc}); re-materialize "
                f"tokenized_shards partition {shard_id}"
            ) from None
        tokens = table.column("tokens").combine_chunks()
        starts = _ints(tokens.offsets)
        self.shard_id, self.path = shard_id, path
        self.starts = starts - starts[0]
        self.values = _ints(tokens.flatten())
        self.rows = _ints(table.column("row").combine_chunks())
        meta = table.schema.metadata or {}
        self.tokenizer_id = meta[b"ghostvis.tokenizer_id"].decode() if b"ghostvis.tokenizer_id" in meta else None
        names = set(table.column_names)
        self.mask = table.column("mask").to_pylist() if "mask" in names else None
        self.images = table.column("image").to_pylist() if "image" in names else None
        self.prompt_len = table.column("prompt_len").to_pylist() if "prompt_len" in names else None
        self.chosen_len = table.column("chosen_len").to_pylist() if "chosen_len" in names else None

    @property
    def num_docs(self) -> int:
        return len(self.rows)

    @property
    def num_tokens(self) -> int:
        return int(self.starts[-1])

    def tokens(self, a: int, b: int) -> np.ndarray:
        return self.values[a:b]

    def doc(self, d: int) -> np.ndarray:
        return self.values[self.starts[d] : self.starts[d + 1]]

    def doc_span(self, d: int) -> tuple[int, int]:
        return int(self.starts[d]), int(self.starts[d + 1])

    def doc_mask(self, d: int) -> np.ndarray:
        n = int(self.starts[d + 1] - self.starts[d])
        return np.ones(n, np.int64) if self.mask is None else np.asarray(self.mask[d], dtype=np.int64)

    def image(self, d: int) -> bytes | None:
        return None if self.images is None else self.images[d]

    def rows_of(self, a: int, b: int) -> tuple[int, int]:
        """Raw rows [first, last) whose documents hold any of the tokens [a, b)."""
        first = int(np.searchsorted(self.starts, a, side="right")) - 1
        last = int(np.searchsorted(self.starts, b, side="left"))
        return int(self.rows[first]), int(self.rows[last - 1]) + 1

"""A source's token shards as one seekable token stream, and a row-level mixture schedule.

Every position is arithmetic: reading global row g costs the same at g = 10 as at g = 10^9
(a binary search over shard boundaries), which is what makes resume a seek, never a replay.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from ghostvis_core.data.shard_piece import Piece
from ghostvis_core.data.shard_ref import ShardRef
from ghostvis_core.data.token_shard import TokenShard
from ghostvis_core.errors import GhostvisError


def local_file(ref: ShardRef) -> Path:
    """A shard whose `path` is a file on this machine already."""
    return Path(ref.path)


class SourceStream:
    """The shards of one source concatenated; epoch e > 0 visits them in a seeded shuffled order. A shard's
    token file is fetched (`fetch`: ref -> a local path) when the stream first opens it."""

    def __init__(
        self, source: str, refs: Sequence[ShardRef], seed: int, fetch: Callable[[ShardRef], Path] = local_file
    ):
        if not refs:
            raise GhostvisError(f"source '{source}': no tokenized shards selected; materialize tokenized_shards for it")
        self.source = source
        self.refs = sorted(refs, key=lambda r: r.shard_id)
        self.seed, self.fetch = seed, fetch
        self.total = sum(r.tokens for r in self.refs)
        self._open: dict[str, TokenShard] = {}
        self._orders: dict[int, tuple[list[ShardRef], list[int]]] = {}

    def _order(self, epoch: int) -> tuple[list[ShardRef], list[int]]:
        if epoch not in self._orders:
            order = list(self.refs)
            if epoch > 0:
                random.Random(f"{self.seed}:{self.source}:{epoch}").shuffle(order)
            starts = [0]
            for r in order:
                starts.append(starts[-1] + r.tokens)
            self._orders[epoch] = (order, starts)
        return self._orders[epoch]

    def shard(self, ref: ShardRef) -> TokenShard:
        if ref.shard_id not in self._open:
            path = self.fetch(ref)
            shard = TokenShard.open(path, ref.shard_id)
            if shard.num_tokens != ref.tokens:
                raise GhostvisError(
                    f"token shard {ref.shard_id}: {shard.num_tokens} tokens on disk, ledger says {ref.tokens}; "
                    f"delete {path} and re-materialize tokenized_shards partition {ref.shard_id}"
                )
            self._open[ref.shard_id] = shard
        return self._open[ref.shard_id]

    def read(self, start: int, end: int) -> tuple[np.ndarray, list[Piece]]:
        """Stream tokens [start, end), wrapping into later epochs; returns tokens and their pieces."""
        parts: list[np.ndarray] = []
        pieces: list[Piece] = []
        pos = start
        while pos < end:
            epoch, off = divmod(pos, self.total)
            order, starts = self._order(epoch)
            i = bisect.bisect_right(starts, off) - 1
            ref = order[i]
            a = off - starts[i]
            b = min(ref.tokens, a + (end - pos))
            parts.append(self.shard(ref).slice(a, b))
            pieces.append(Piece(self.source, ref.shard_id, ref.split, epoch, a, b))
            pos += b - a
        tokens = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return tokens, pieces

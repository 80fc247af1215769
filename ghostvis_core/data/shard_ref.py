"""ShardRef: a tokenized shard as the ledger knows it, and as a launch spec selects it.

Its own module, importing nothing, so the records that carry shard refs (the launch spec, the ledger's
split check) and the audit that reads them do not reach the loader's stream code (data/stream.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShardRef:
    """A tokenized shard; `path` is where its token file is (a launch spec's: the store URI, which the
    stream's `fetch` turns into this node's copy when it opens the shard)."""

    shard_id: str
    source: str
    split: str
    path: str
    docs: int
    tokens: int
    content_sha256: str = ""

"""Piece: a token range of one shard read in one epoch, what the loader's streams deliver.

Its own module, importing nothing, so the ledger's consumption row can be a Piece (records.py) without
the ledger, or the audit that reads it, reaching the loader's stream code (data/stream.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Piece:
    """Tokens [tok_start, tok_end) of one shard (shard-local coordinates) read in one epoch; `tokens` is
    their number (a field, not given: the ledger's consumption table stores it as a column)."""

    source: str
    shard_id: str
    split: str
    epoch: int
    tok_start: int
    tok_end: int
    tokens: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", self.tok_end - self.tok_start)

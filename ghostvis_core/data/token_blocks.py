"""Per-block digests of a token file's token ids, so a file is verified as it is read.

Tokenization writes the sha256 of every block of BLOCK_TOKENS tokens (shard-local token coordinates) into
the token file's schema metadata (BLOCKS_KEY). A reader checks a block the first time it reads any of its
tokens, before they reach the model: a file changed after it was written (bit rot, a bad copy, a hand
re-tokenization under the same name) stops the job at the first block it changed. Each block is hashed
once per open file, so the cost grows with the tokens read, not with the size of the shards.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ghostvis_core.errors import GhostvisError

BLOCKS_KEY = "ghostvis.token_blocks"  # schema metadata: {"block_tokens": n, "sha256": [one per block]}
BLOCK_TOKENS = 1 << 16  # tokens one digest covers; the last block of a file may be shorter


def block_sha256(values: np.ndarray) -> str:
    """The digest of one block: sha256 of its token ids' bytes as stored (the file's dtype)."""
    return hashlib.sha256(np.ascontiguousarray(values).data).hexdigest()


@dataclass(frozen=True)
class TokenBlocks:
    """The block size and the digest of each block of one token file's tokens."""

    block_tokens: int
    sha256: tuple[str, ...]

    @classmethod
    def of(cls, tokens: np.ndarray, block_tokens: int = BLOCK_TOKENS) -> TokenBlocks:
        """The digests of `tokens` (a file's tokens in shard-local coordinates), block by block."""
        starts = range(0, len(tokens), block_tokens)
        return cls(block_tokens, tuple(block_sha256(tokens[s : s + block_tokens]) for s in starts))

    def to_metadata(self) -> str:
        return json.dumps({"block_tokens": self.block_tokens, "sha256": list(self.sha256)})

    @classmethod
    def from_metadata(cls, metadata: dict[bytes, bytes] | None) -> TokenBlocks | None:
        """The digests a token file's schema metadata holds; None for a file written without them."""
        raw = (metadata or {}).get(BLOCKS_KEY.encode())
        if raw is None:
            return None
        held = json.loads(raw)
        return cls(int(held["block_tokens"]), tuple(held["sha256"]))


@dataclass
class BlockCheck:
    """The blocks of one open token file that were checked already; `cover` checks the rest as they are read."""

    shard_id: str
    path: Path
    digests: TokenBlocks | None
    checked: set[int] = field(default_factory=set)

    def cover(self, tokens: np.ndarray, start: int, end: int) -> None:
        """Check every block that tokens [start, end) touch and that was not checked yet; `tokens` is the
        whole file's tokens in shard-local coordinates."""
        if end <= start:
            return
        if self.digests is None:
            raise GhostvisError(
                f"token shard {self.shard_id}: file {self.path} has no block digests (written before tokenization "
                f"recorded them), so its tokens cannot be verified as they are read; re-materialize "
                f"tokenized_shards partition {self.shard_id}"
            )
        size = self.digests.block_tokens
        for k in range(start // size, (end - 1) // size + 1):
            if k not in self.checked:
                self._check(k, tokens[k * size : (k + 1) * size])
                self.checked.add(k)

    def _check(self, k: int, block: np.ndarray) -> None:
        size, want = self.digests.block_tokens, self.digests.sha256
        got = block_sha256(block) if k < len(want) else "no such block"
        if k >= len(want) or got != want[k]:
            expected = want[k] if k < len(want) else f"{len(want)} blocks"
            raise GhostvisError(
                f"token shard {self.shard_id}: block {k} (tokens {k * size:,}-{k * size + len(block):,}) of file "
                f"{self.path} does not match the digest written at tokenization (expected {expected}, got {got}): "
                f"the file changed after it was written; delete it and re-materialize tokenized_shards partition "
                f"{self.shard_id}"
            )

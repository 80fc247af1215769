"""Which shards changed since something was made of them, by content: a tokenizer (the text shards its identity
names) or a run (the shard versions its launch spec selected).

A shard revised upstream is a new version under the same name (raw_shards records its content hash,
`catalog.record_raw_shard`). What was made of the old version stays as it was: a trained tokenizer is kept and
tokenizes the new version (retraining it is a choice, since a new tokenizer re-tokenizes every shard and makes
every trained stage stale), and a run keeps the versions it trained. These changes are what `ghostvis status` and
`ghostvis data` name: the shard and both sha256.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ghostvis_core.data.catalog import recorded_sha256
from ghostvis_core.data.data_identities import tokenizer_identity
from ghostvis_core.store import Store

# What a trained tokenizer's identity holds besides its training data: the part that makes it another tokenizer.
TRAINING_DATA = "text_shards"


@dataclass(frozen=True)
class ShardChange:
    """One shard whose recorded content (and split) is not the one something was made of."""

    shard_id: str
    made_of: str | None  # sha256 of the version used then (None: the shard was not there, or not downloaded)
    now: str | None  # sha256 raw_shards records now (None: no longer listed, or not downloaded)
    split_then: str | None = None
    split_now: str | None = None

    def describe(self) -> str:
        """The shard and both sha256, "demo_prose/00001 (sha256 <old> -> <new>)", and a split that changed."""
        moved = self.split_then and self.split_now and self.split_then != self.split_now
        split = f", split {self.split_then} -> {self.split_now}" if moved else ""
        return f"{self.shard_id} (sha256 {self.made_of or 'none'} -> {self.now or 'none'}{split})"


def describe_changes(changes: list[ShardChange], shown: int) -> str:
    """The first `shown` changes described, and how many more there are."""
    more = f"; and {len(changes) - shown} more" if len(changes) > shown else ""
    return "; ".join(c.describe() for c in changes[:shown]) + more


def changed_shards(then: Mapping[str, Any], now: Mapping[str, Any]) -> list[ShardChange]:
    """The shards, by name, whose entry differs between two {shard_id: sha256 or [sha256, split]} maps."""
    out = []
    for shard_id in sorted(set(then) | set(now)):
        old, new = _sha_split(then.get(shard_id)), _sha_split(now.get(shard_id))
        if old != new:
            out.append(ShardChange(shard_id, old[0], new[0], old[1], new[1]))
    return out


def _sha_split(entry: Any) -> tuple[str | None, str | None]:
    if isinstance(entry, (list, tuple)):
        return entry[0], entry[1]
    return entry, None


def training_data_changes(made: Mapping[str, Any], asked: Mapping[str, Any]) -> list[ShardChange] | None:
    """Between a trained tokenizer's identity (`made`) and the one asked for now: the text shards that changed
    when nothing else did ([] when both are equal); None when another part differs (the vocabulary, the byte
    cap), which asks for another tokenizer."""
    rest = {k: v for k, v in made.items() if k != TRAINING_DATA}
    if rest != {k: v for k, v in asked.items() if k != TRAINING_DATA}:
        return None
    return changed_shards(made.get(TRAINING_DATA, {}), asked.get(TRAINING_DATA, {}))


def tokenizer_data_changes(store: Store, made: Mapping[str, Any]) -> list[ShardChange]:
    """The text shards that changed since a tokenizer of identity `made` (its identity record's `identity`) was
    trained: revised, added or removed upstream."""
    now = tokenizer_identity(store, made["vocab_size"], made["max_train_bytes"])
    return changed_shards(made.get(TRAINING_DATA, {}), now[TRAINING_DATA])


def run_data_changes(store: Store, versions: Mapping[str, str]) -> list[ShardChange]:
    """The shards of a run (`versions`: shard_id -> the content sha256 its launch spec selected,
    `spec.shard_versions`) whose recorded content is another version now; a shard selected without its
    content hash (a spec older than content hashes) is not compared."""
    known = {shard_id: sha for shard_id, sha in versions.items() if sha}
    return changed_shards(known, {shard_id: recorded_sha256(store, shard_id) for shard_id in known})

"""Identities of the data artifacts (ghostvis_core/identity.py): manifests, raw shards, tokenizer
inputs, the ledger. Built from the manifests, the content hashes raw_shards recorded when it
downloaded and verified each shard (artifact kind "raw_shard_meta") and the ledger's shard rows:
no shard file is read, and no URL or path enters them.
"""

from __future__ import annotations

from typing import Any

from ghostvis_core.data.catalog import recorded_sha256, registered_manifests, shard_split
from ghostvis_core.data.ledger.records import ShardRecord
from ghostvis_core.data.shard_manifest import Manifest
from ghostvis_core.store import Store


def manifest_identity(manifests: list[Manifest]) -> dict[str, Any]:
    """What each source's shard list says a shard is (name, pin, size, content hash), not where it is."""
    return {
        m.source: {
            "kind": m.kind,
            "validation_sha256": sorted(m.validation_sha256),
            "shards": [[e.name, e.split, e.bytes, e.sha256] for e in m.shards],
            # how rows are read and rewarded: set only where declared, so other sources' identities stay
            **({"columns": m.columns} if m.columns else {}),
            **({"reward": m.reward} if m.reward else {}),
        }
        for m in manifests
    }


def shard_contents(store: Store) -> dict[str, str | None]:
    """Every registered shard's content hash as raw_shards recorded it (None: not downloaded yet)."""
    return {
        m.shard_id(e): recorded_sha256(store, m.shard_id(e))
        for m in registered_manifests(store).values()
        for e in m.shards
    }


def tokenizer_identity(store: Store, vocab_size: int, max_train_bytes: int) -> dict[str, Any]:
    """What the tokenizer trains on: the text shards by content, their splits, the vocabulary and byte cap."""
    shards = {}
    for manifest in registered_manifests(store).values():
        if manifest.kind != "text":
            continue
        for e in manifest.shards:
            sid = manifest.shard_id(e)
            sha = recorded_sha256(store, sid)
            shards[sid] = [sha, shard_split(store, manifest, sid) if sha else None]
    return {"vocab_size": vocab_size, "max_train_bytes": max_train_bytes, "text_shards": shards}


def ledger_identity(rows: list[ShardRecord]) -> dict[str, Any]:
    """The ledger's shard table for one tokenizer: each shard's content, split and counts."""
    return {r.shard_id: [r.content_sha256, r.split, r.docs, r.tokens] for r in rows}

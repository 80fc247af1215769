"""`ghostvis verify-model DIR [--store URI]`: is what an exported model says it was trained on consistent,
and true?

Without a store, from the folder alone: the card's manifest sha256 is the manifest file's, every sum in
the manifest adds up (a source's tokens and raw rows are its shards'), and the card's every generated line
is the one the manifest renders. With the store: the manifest rebuilt from the ledger (every figure and
Merkle root, ghostvis_core/run/hf/manifest.py) equals the shipped one, and every token file a stage read
still has the sha256 the ledger recorded when it was written. The first difference is the answer.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from ghostvis_core.data.ledger import Ledger
from ghostvis_core.errors import GhostvisError
from ghostvis_core.run.hf.card import CARD_FILE, DIGEST_KEY, card_licence, card_metadata, render_card
from ghostvis_core.run.hf.manifest import MANIFEST_FILE, MANIFEST_FORMAT, build_manifest
from ghostvis_core.store import Store
from ghostvis_core.store.files import sha256_file


def read_manifest(folder: Path) -> tuple[dict[str, Any], str]:
    """The shipped manifest and the sha256 of its file's bytes."""
    path = Path(folder) / MANIFEST_FILE
    if not path.is_file():
        raise GhostvisError(f"{folder}: no {MANIFEST_FILE}; export the model with `ghostvis export` to add one")
    data = path.read_bytes()
    try:
        manifest = json.loads(data)
    except json.JSONDecodeError as exc:
        raise GhostvisError(f"{path}: not JSON ({exc}); re-export the model") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise GhostvisError(f"{path}: not a {MANIFEST_FORMAT} manifest; re-export the model")
    return manifest, hashlib.sha256(data).hexdigest()


def first_difference(shipped: Any, rebuilt: Any, where: str = "") -> str | None:
    """The first path (keys sorted, lists in order) where the two JSON values differ, with both values."""
    if isinstance(shipped, dict) and isinstance(rebuilt, dict):
        for key in sorted(set(shipped) | set(rebuilt)):
            if key not in shipped or key not in rebuilt:
                return f"{where}.{key}: {'missing from the manifest' if key not in shipped else 'not in the ledger'}"
            found = first_difference(shipped[key], rebuilt[key], f"{where}.{key}")
            if found:
                return found
        return None
    if isinstance(shipped, list) and isinstance(rebuilt, list):
        for i, (a, b) in enumerate(zip(shipped, rebuilt)):
            found = first_difference(a, b, f"{where}[{i}]")
            if found:
                return found
        if len(shipped) != len(rebuilt):
            return f"{where}: {len(shipped)} entries in the manifest, {len(rebuilt)} in the ledger"
        return None
    return None if shipped == rebuilt else f"{where}: the manifest says {shipped!r}, the ledger {rebuilt!r}"


def sums_difference(manifest: dict[str, Any]) -> str | None:
    """The first source whose tokens or raw rows are not its shards' sum."""
    for i, stage in enumerate(manifest["stages"]):
        for j, src in enumerate(stage["sources"]):
            where = f"stages[{i}].sources[{j}] ({stage['stage']} {src['source']})"
            tokens = sum(s["tokens"] for s in src["shards"])
            rows = sum(s["rows_read"] for s in src["shards"])
            if tokens != src["tokens"]:
                return f"{where}: tokens {src['tokens']}, but its shards sum to {tokens}"
            if rows != src["rows_read"]:
                return f"{where}: raw rows read {src['rows_read']}, but its shards sum to {rows}"
    return None


def card_difference(folder: Path, manifest: dict[str, Any], digest: str) -> str | None:
    """The card's manifest sha256 against the file's, then its first line that the manifest does not render."""
    path = Path(folder) / CARD_FILE
    if not path.is_file():
        return f"{CARD_FILE}: missing; re-export the model"
    text = path.read_text()
    stated = card_metadata(text).get(DIGEST_KEY)
    if stated != digest:
        return f"{CARD_FILE}: {DIGEST_KEY} is {stated}, but {MANIFEST_FILE} has sha256 {digest}"
    expected = render_card(manifest, digest, card_licence(text)).splitlines()
    for n, (got, want) in enumerate(zip(text.splitlines(), expected), start=1):
        if got != want:
            return f"{CARD_FILE} line {n}: {got!r}; the manifest renders {want!r}"
    if len(text.splitlines()) != len(expected):
        return f"{CARD_FILE}: {len(text.splitlines())} lines; the manifest renders {len(expected)}"
    return None


def token_file_difference(store: Store, manifest: dict[str, Any]) -> str | None:
    """The first token file a stage read whose sha256 is not the one the ledger recorded for it."""
    for stage in manifest["stages"]:
        for src in stage["sources"]:
            for shard in src["shards"]:
                path = store.fetch("token_shard", stage["tokenizer_id"], shard["shard_id"], shard["content_sha256"])
                got = sha256_file(path)
                if got != shard["token_sha256"]:
                    return (
                        f"token file {path} of shard {shard['shard_id']} (read by {stage['stage']}): sha256 {got}, "
                        f"the ledger recorded {shard['token_sha256']}; re-materialize tokenized_shards partition "
                        f"{shard['shard_id']}"
                    )
    return None


def verify_model(folder: Path, store: Store | None = None) -> str | None:
    """The first difference found in the exported model at `folder` (None: it checks out)."""
    manifest, digest = read_manifest(folder)
    found = sums_difference(manifest) or card_difference(folder, manifest, digest)
    if found or store is None:
        return found
    model = manifest["model"]
    rebuilt = build_manifest(store, Ledger.in_store(store), model["stage"], model["run_key"])
    found = first_difference(manifest, rebuilt)
    return f"{MANIFEST_FILE} {found.removeprefix('.')}" if found else token_file_difference(store, manifest)

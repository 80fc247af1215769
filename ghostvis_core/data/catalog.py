"""Which sources exist: the manifests the pipeline registered (one per source in the store, artifact
kind "manifest").

And which split each shard is in: `shard_split`, the one resolution every reader uses (the tokenizer,
tokenized_shards, shard_manifest's table, the tokenizer check). It applies `Manifest.split_of` (name
pin or content pin -> validation) to the shard's content hash, recorded by raw_shards when it
downloaded and verified the shard (artifact kind "raw_shard_meta").
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq

from ghostvis_core.data.normalize_shard import check_columns_mapping
from ghostvis_core.data.problems import check_reward_rule
from ghostvis_core.data.schema import check_kind
from ghostvis_core.data.shard_manifest import (
    SHARD_SUFFIXES,
    Manifest,
    ShardEntry,
    check_pins,
    list_remote,
    manifest_from_pattern,
    shard_name,
)
from ghostvis_core.errors import GhostvisError
from ghostvis_core.store import Store
from ghostvis_core.store.files import sha256_file


@dataclass
class RemoteSource:
    """A user's source: shards from a URL pattern over a shard range, or from a listing
    (file:// folder, s3://bucket/prefix, or an http(s) .json listing)."""

    name: str
    kind: str = "text"
    url_pattern: str = ""  # e.g. https://host/data/{shard:05d}.parquet (Hub `resolve/` URLs work)
    listing: str = ""
    first_shard: int = 0
    num_shards: int = 0  # with a listing, 0 = all listed shards
    validation: list[str] = field(default_factory=list)  # shard names pinned as validation
    validation_sha256: list[str] = field(default_factory=list)  # or pinned by content hash
    sha256: dict[str, str] = field(default_factory=dict)  # expected content hash per shard name
    columns: dict[str, str] = field(default_factory=dict)  # the kind's field -> the column your files name it
    reward: str = ""  # kind problem: integer (default), string or regex:<pattern> (ghostvis_core/data/problems.py)


# A source name is a path segment of the store and the first half of every partition key <source>/<shard>.
SOURCE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")


def check_declarations(declared: list[tuple[str, str]]) -> None:
    """The (name, kind) of every source a shard_manifest run registers, checked before anything is
    written: each name a plain identifier (no separator, no `..`, nothing absolute, no control byte),
    declared once, of a known kind."""
    for name, kind in declared:
        if not isinstance(name, str) or not SOURCE_NAME.fullmatch(name) or ".." in name:
            raise GhostvisError(
                f"source name {name!r} is not a plain identifier; name it with letters, digits, '_', '-' or '.' "
                f"(at most 100, starting with a letter or digit, no '/' and no '..'), e.g. my_corpus"
            )
        check_kind(name, kind)
    twice = sorted(n for n, c in Counter(n for n, _ in declared).items() if c > 1)
    if twice:
        raise GhostvisError(
            f"source(s) {', '.join(twice)} declared more than once in this shard_manifest run; a later one would "
            f"replace the first one's manifest: keep one declaration per name, or rename one"
        )


def remote_manifest(src: RemoteSource) -> Manifest:
    check_kind(src.name, src.kind)
    check_columns_mapping(src.name, src.kind, src.columns)
    reward = check_reward_rule(src.name, src.kind, src.reward)
    if src.first_shard < 0 or src.num_shards < 0:
        raise GhostvisError(
            f"source {src.name}: first_shard={src.first_shard} and num_shards={src.num_shards} must be 0 or more; "
            f"fix the shard range"
        )
    if bool(src.url_pattern) == bool(src.listing):
        raise GhostvisError(f"source {src.name}: give exactly one of url_pattern or listing")
    if src.url_pattern:
        if src.num_shards <= 0:
            raise GhostvisError(f"source {src.name}: num_shards must be positive with a url_pattern")
        m = manifest_from_pattern(
            src.name,
            src.url_pattern,
            range(src.first_shard, src.first_shard + src.num_shards),
            src.validation,
            src.sha256,
            src.kind,
        )
    else:
        listed = list_remote(src.listing)
        listed = listed[src.first_shard : src.first_shard + src.num_shards if src.num_shards else None]
        if not listed:
            beyond = f" from shard {src.first_shard}" if src.first_shard else ""
            raise GhostvisError(
                f"source {src.name}: no {' or '.join(SHARD_SUFFIXES)} shards found at {src.listing}{beyond}; "
                f"check the listing URL and the shard range"
            )
        names = [shard_name(url) for url, _ in listed]
        check_pins(src.name, names, set(src.validation) | src.sha256.keys(), f"listed at {src.listing}")
        m = Manifest(
            src.name,
            src.kind,
            [
                ShardEntry(name, url, "validation" if name in src.validation else "train", size, src.sha256.get(name))
                for name, (url, size) in zip(names, listed)
            ],
        )
    m.validation_sha256 = [_sha256_pin(src.name, d) for d in src.validation_sha256]
    m.columns, m.reward = dict(src.columns), reward
    return m


def _sha256_pin(source: str, digest: str) -> str:
    d = digest.strip().lower()
    if not re.fullmatch(r"[0-9a-f]{64}", d):
        raise GhostvisError(
            f"source {source}: validation_sha256 pin {digest!r} is not a sha256 digest; "
            f"give the 64 hex digits of the shard file's sha256 (e.g. from `sha256sum`)"
        )
    return d


def save_manifest(store: Store, manifest: Manifest) -> str:
    """Register a source's manifest in the store (atomically); returns its URI."""
    return store.write_text("manifest", manifest.source, text=manifest.to_json())


def load_manifest(store: Store, source: str) -> Manifest:
    if not store.exists("manifest", source):
        raise GhostvisError(f"source {source} has no manifest; materialize shard_manifest first")
    return Manifest.from_dict(store.read_json("manifest", source))


def registered_manifests(store: Store) -> dict[str, Manifest]:
    """Every registered source's manifest, by source name (sorted)."""
    return {source: load_manifest(store, source) for (source,) in sorted(store.keys("manifest"))}


def manifest_of_shard(store: Store, shard_id: str) -> Manifest:
    source = shard_id.split("/", 1)[0]
    if not store.exists("manifest", source):
        raise GhostvisError(f"shard {shard_id}: source {source} has no manifest; materialize shard_manifest first")
    return load_manifest(store, source)


def manifests_of_shards(store: Store, shard_ids: list[str]) -> dict[str, Manifest]:
    """shard_id -> its source's manifest, each source's manifest read once: a backfill of N shards
    reads its few sources, not N manifests of N entries each."""
    by_source: dict[str, Manifest] = {}
    for sid in shard_ids:
        source = sid.split("/", 1)[0]
        if source not in by_source:
            by_source[source] = manifest_of_shard(store, sid)
    return {sid: by_source[sid.split("/", 1)[0]] for sid in shard_ids}


# --- splits: one rule (Manifest.split_of), resolved from the downloaded shard's content ----------


def record_raw_shard(store: Store, manifest: Manifest, shard_id: str, sha256: str, size: int) -> str:
    """What raw_shards learned downloading and verifying a shard: its content hash, size, and the split
    the rule gives it. A shard is its content: when the content differs from the one recorded, the
    record of each earlier version stays under `versions` (oldest first). Returns the split."""
    split = manifest.split_of(manifest.entry(shard_id), sha256)
    record = {"shard_id": shard_id, "sha256": sha256, "bytes": size, "split": split}
    before = store.read_json("raw_shard_meta", shard_id) if store.exists("raw_shard_meta", shard_id) else None
    if before is not None:
        earlier = before.pop("versions", [])
        before.pop("shard_id")
        versions = earlier + [before] if before["sha256"] != sha256 else earlier
        record |= {"versions": versions} if versions else {}
    store.write_json("raw_shard_meta", shard_id, data=record)
    return split


def recorded_sha256(store: Store, shard_id: str) -> str | None:
    """The content hash raw_shards recorded for the shard, or None if it has not downloaded it."""
    return store.read_json("raw_shard_meta", shard_id)["sha256"] if store.exists("raw_shard_meta", shard_id) else None


def replaced_sha256(store: Store, shard_id: str) -> str:
    """The content hash of the shard's version before its recorded one ("" for a first version)."""
    if not store.exists("raw_shard_meta", shard_id):
        return ""
    versions = store.read_json("raw_shard_meta", shard_id).get("versions", [])
    return versions[-1]["sha256"] if versions else ""


def keep_replaced_version(store: Store, shard_id: str, new_sha256: str) -> None:
    """Before a download of other content takes the shard's name: keep the present file as the version
    of its recorded content (`raw_shard_version`), so what runs trained on stays readable by content.
    A present file whose content is not the recorded one is not kept under that hash."""
    old = recorded_sha256(store, shard_id)
    if old is None or old == new_sha256 or store.exists("raw_shard_version", shard_id, old):
        return
    if store.exists("raw_shard", shard_id):
        present = store.fetch("raw_shard", shard_id)
        if sha256_file(present) == old:
            store.put_file("raw_shard_version", shard_id, old, src=present)


def raw_content(store: Store, shard_id: str, sha256: str) -> Path:
    """The raw file of the shard's version with this content: the file under its name when it holds
    that content, else the version kept when the content changed; refused naming both otherwise."""
    if not store.exists("raw_shard", shard_id):
        raise GhostvisError(
            f"raw shard {shard_id} is not in the store ({store.uri_of('raw_shard', shard_id)}); "
            f"materialize raw_shards partition {shard_id}"
        )
    path = store.fetch("raw_shard", shard_id)
    got = sha256_file(path)
    if got == sha256:
        return path
    if store.exists("raw_shard_version", shard_id, sha256):
        kept = store.fetch("raw_shard_version", shard_id, sha256)
        if sha256_file(kept) == sha256:
            return kept
    raise GhostvisError(
        f"raw shard {shard_id} ({path}): content changed since it was recorded (expected sha256 {sha256}, "
        f"got {got}) and no version of that content is kept; re-materialize raw_shards partition {shard_id}"
    )


def shard_split(store: Store, manifest: Manifest, shard_id: str, content_sha256: str | None = None) -> str:
    """ "train" or "validation": the split rule (Manifest.split_of) applied to the shard's content hash,
    the one raw_shards recorded and, when the caller hashed the raw file it is about to read, that one
    too: if the file changed since its download, validation under either hash wins."""
    entry = manifest.entry(shard_id)
    digests = {d for d in (content_sha256, recorded_sha256(store, shard_id)) if d}
    if not digests and store.exists("raw_shard", shard_id):  # downloaded before raw_shards kept records
        digests.add(sha256_file(store.fetch("raw_shard", shard_id)))
    if not digests:
        raise GhostvisError(f"shard {shard_id} is not downloaded; materialize raw_shards partition {shard_id} first")
    splits = {manifest.split_of(entry, d) for d in digests}
    return "validation" if "validation" in splits else "train"


def shard_split_shown(store: Store, manifest: Manifest, shard_id: str) -> str:
    """The split for a table, before the shard may be downloaded: the rule applied to the recorded
    content hash, else to the manifest's expected one (a download is verified against it)."""
    entry = manifest.entry(shard_id)
    split = manifest.split_of(entry, recorded_sha256(store, shard_id) or entry.sha256)
    return split or "pending download (sha256 pins)"


def unmatched_sha256_pins(store: Store, manifest: Manifest) -> list[str] | None:
    """The source's validation_sha256 pins that match no shard's content; None while some shard's
    content is unknown (neither in the manifest nor downloaded)."""
    if not manifest.validation_sha256:
        return []
    digests = [e.sha256 or recorded_sha256(store, manifest.shard_id(e)) for e in manifest.shards]
    return None if None in digests else manifest.unmatched_sha256_pins(digests)


def check_sha256_pins(store: Store, manifest: Manifest, where: str) -> None:
    """Fail when every shard's content is known and a validation_sha256 pin matches none of them."""
    unmatched = unmatched_sha256_pins(store, manifest)
    if unmatched:
        raise GhostvisError(
            f"source {manifest.source}: validation_sha256 pin(s) {unmatched} match none of its "
            f"{len(manifest.shards)} shards' content (checked in {where}); a pin must be the sha256 of one of the "
            f"source's files (each raw_shards partition's metadata shows its sha256): fix or remove the pin and "
            f"re-materialize shard_manifest"
        )


@dataclass
class TokenizerCorpus:
    """The text the tokenizer trains on: only shards whose resolved split is train."""

    texts: list[str] = field(default_factory=list)
    train_shard_ids: list[str] = field(default_factory=list)
    validation_shard_ids: list[str] = field(default_factory=list)  # resolved validation: left out
    train_bytes: int = 0


def tokenizer_corpus(store: Store, max_train_bytes: int) -> TokenizerCorpus:
    """Texts of the downloaded train shards of the text sources, in manifest order, up to
    max_train_bytes. Each shard's split is resolved from the content of the very file read."""
    corpus = TokenizerCorpus()
    for manifest in registered_manifests(store).values():
        if manifest.kind != "text":
            continue
        check_sha256_pins(store, manifest, "the tokenizer asset")
        for e in manifest.shards:
            if corpus.train_bytes >= max_train_bytes:
                return corpus
            sid = manifest.shard_id(e)
            if not store.exists("raw_shard", sid):
                raise GhostvisError(f"shard {sid} is not downloaded; materialize raw_shards partition {sid} first")
            path = store.fetch("raw_shard", sid)
            if shard_split(store, manifest, sid, sha256_file(path)) != "train":
                corpus.validation_shard_ids.append(sid)
                continue
            for text in pq.read_table(path, columns=["text"]).column("text").to_pylist():
                corpus.texts.append(text)
                corpus.train_bytes += len(text.encode("utf-8"))
            corpus.train_shard_ids.append(sid)
    return corpus

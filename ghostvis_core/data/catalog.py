"""Which sources exist: the embedded demo sources, published locally as if remote, and the
manifests the pipeline registered (one per source in the store, artifact kind "manifest")."""

from __future__ import annotations

from ghostvis_core.data.demo_corpus import TEXT_SOURCES, build_text_source
from ghostvis_core.data.demo_tasks import TASK_SOURCES, build_task_source
from dataclasses import dataclass, field
from pathlib import Path

from ghostvis_core.data.sources import Manifest, ShardEntry, list_remote, manifest_for_files, manifest_from_pattern
from ghostvis_core.errors import GhostvisError
from ghostvis_core.home import Home
from ghostvis_core.store import LocalStore

# source -> kind, in the order the demo registers them
DEMO_SOURCES: dict[str, str] = {**{s: "text" for s in TEXT_SOURCES}, **TASK_SOURCES}


def publish_demo_source(home: Home, source: str) -> Manifest:
    """Build a demo source under <home>/sources/<source>/ once; its manifest has file:// URLs."""
    out = home.sources / source
    manifest_path = out / "manifest.json"
    if manifest_path.exists():
        return Manifest.load(manifest_path)
    if source not in DEMO_SOURCES:
        raise GhostvisError(f"unknown demo source '{source}'; demo sources are: {', '.join(DEMO_SOURCES)}")
    files = build_text_source(source, out) if source in TEXT_SOURCES else build_task_source(source, out)
    manifest = manifest_for_files(source, DEMO_SOURCES[source], files)
    manifest.save(manifest_path)  # last: a source without its manifest is rebuilt
    return manifest


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


def remote_manifest(src: RemoteSource) -> Manifest:
    if bool(src.url_pattern) == bool(src.listing):
        raise GhostvisError(f"source {src.name}: give exactly one of url_pattern or listing")
    if src.url_pattern:
        if src.num_shards <= 0:
            raise GhostvisError(f"source {src.name}: num_shards must be positive with a url_pattern")
        m = manifest_from_pattern(src.name, src.url_pattern, range(src.first_shard, src.first_shard + src.num_shards),
                                  src.validation, src.sha256, src.kind)
    else:
        listed = list_remote(src.listing)
        listed = listed[src.first_shard : src.first_shard + src.num_shards if src.num_shards else None]
        if not listed:
            raise GhostvisError(f"source {src.name}: no .parquet shards found at {src.listing}")
        m = Manifest(src.name, src.kind, [
            ShardEntry(Path(url.rsplit("/", 1)[-1]).stem, url, "validation" if Path(url).stem in src.validation else "train",
                       size, src.sha256.get(Path(url).stem)) for url, size in listed])
    m.validation_sha256 = list(src.validation_sha256)
    return m


def manifest_path(store: LocalStore, source: str) -> Path:
    return store.path("manifest", source)


def save_manifest(store: LocalStore, manifest: Manifest) -> Path:
    """Register a source's manifest in the store (atomically)."""
    return store.write_text("manifest", manifest.source, text=manifest.to_json())


def load_manifest(store: LocalStore, source: str) -> Manifest:
    if not store.exists("manifest", source):
        raise GhostvisError(f"source {source} has no manifest; materialize shard_manifest first")
    return Manifest.from_dict(store.read_json("manifest", source))


def registered_manifests(store: LocalStore) -> dict[str, Manifest]:
    """Every registered source's manifest, by source name (sorted)."""
    return {source: load_manifest(store, source) for (source,) in sorted(store.keys("manifest"))}


def manifest_of_shard(store: LocalStore, shard_id: str) -> Manifest:
    source = shard_id.split("/", 1)[0]
    if not store.exists("manifest", source):
        raise GhostvisError(f"shard {shard_id}: source {source} has no manifest; materialize shard_manifest first")
    return load_manifest(store, source)

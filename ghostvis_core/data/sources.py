"""Shard manifests and the one download path every source uses.

A manifest lists a source's shards: name, URL, split, and the expected size and sha256 when known.
`fetch_shard` streams a URL to a temporary name, verifies it, and renames it into place, so a
partial or corrupt file is never left under the final name.
"""

from __future__ import annotations

import hashlib
import json
import os
import urllib.parse
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ghostvis_core.errors import GhostvisError

CHUNK = 1 << 20


@dataclass
class ShardEntry:
    name: str
    url: str
    split: str = "train"
    bytes: int | None = None
    sha256: str | None = None


@dataclass
class Manifest:
    source: str
    kind: str = "text"  # text | chat | preference | image_caption
    shards: list[ShardEntry] = field(default_factory=list)

    def shard_id(self, entry: ShardEntry) -> str:
        return f"{self.source}/{entry.name}"

    def entry(self, shard_id: str) -> ShardEntry:
        for e in self.shards:
            if self.shard_id(e) == shard_id:
                return e
        raise GhostvisError(f"shard {shard_id} is not in the manifest of source {self.source}; re-materialize shard_manifest")

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: Path) -> "Manifest":
        if not path.exists():
            raise GhostvisError(f"manifest {path} is missing; materialize the shard_manifest asset first")
        data = json.loads(path.read_text())
        return cls(data["source"], data.get("kind", "text"), [ShardEntry(**e) for e in data["shards"]])


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def manifest_for_files(source: str, kind: str, files: list[tuple[Path, str]]) -> Manifest:
    """A manifest of local files (file:// URLs) with their sizes and checksums."""
    return Manifest(source, kind, [
        ShardEntry(p.stem, p.resolve().as_uri(), split, p.stat().st_size, sha256_file(p)) for p, split in files
    ])


@dataclass(frozen=True)
class FetchResult:
    path: Path
    bytes: int
    sha256: str
    downloaded: bool  # False: the file was already there with the expected checksum


def fetch_shard(shard_id: str, entry: ShardEntry, dest: Path) -> FetchResult:
    """Download entry.url to dest atomically; verify size and sha256 when the manifest has them."""
    if dest.exists() and entry.sha256 and sha256_file(dest) == entry.sha256:
        return FetchResult(dest, dest.stat().st_size, entry.sha256, downloaded=False)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.part-{uuid.uuid4().hex[:8]}")
    try:
        h = hashlib.sha256()
        size = 0
        with _open_url(shard_id, entry.url) as src, open(tmp, "wb") as out:
            while chunk := src.read(CHUNK):
                out.write(chunk)
                h.update(chunk)
                size += len(chunk)
            out.flush()
            os.fsync(out.fileno())
        digest = h.hexdigest()
        if entry.bytes is not None and size != entry.bytes:
            raise GhostvisError(
                f"shard {shard_id}: size mismatch (expected {entry.bytes} bytes, got {size}) from {entry.url}; "
                f"the source changed or the transfer was cut; re-materialize raw_shards partition {shard_id}"
            )
        if entry.sha256 and digest != entry.sha256:
            raise GhostvisError(
                f"shard {shard_id}: checksum mismatch (expected {entry.sha256}, got {digest}) from {entry.url}; "
                f"fix the manifest's sha256 or the source file, then re-materialize raw_shards partition {shard_id}"
            )
        os.replace(tmp, dest)
        return FetchResult(dest, size, digest, downloaded=True)
    finally:
        tmp.unlink(missing_ok=True)


def _open_url(shard_id: str, url: str):
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme == "file":
        path = Path(urllib.parse.unquote(parsed.path))
        if not path.exists():
            raise GhostvisError(f"shard {shard_id}: {url} does not exist; check the source's manifest")
        return open(path, "rb")
    raise GhostvisError(f"shard {shard_id}: unsupported URL scheme '{parsed.scheme}' in {url}")


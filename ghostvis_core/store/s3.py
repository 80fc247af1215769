"""The artifact store in an S3 bucket: GHOSTVIS_STORE=s3://bucket/prefix, on AWS or any S3-compatible
endpoint (AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL; credentials from the usual AWS environment).

Small records (manifests, run specs and records, markers) are read and written as objects. Files a
library opens are cached on each node under GHOSTVIS_STORE_CACHE (default ~/.cache/ghostvis/store)
in the store's own layout: `fetch()` downloads what is missing there, verified against the sha256
the uploader recorded, and `publish()` uploads what a node wrote at `writable()`, commit markers
last, so a reader never takes an interrupted upload for a complete artifact.
"""

from __future__ import annotations

import json
import os
import urllib.parse
from pathlib import Path
from typing import Any

from ghostvis_core.errors import GhostvisError, TransferError
from ghostvis_core.store.files import remove, replacing, sha256_file
from ghostvis_core.store.folder import missing
from ghostvis_core.store.layout import fill, key_pattern, listing_prefix

# files that say "everything beside me is complete": uploaded after everything else in their folder
COMMIT_MARKERS = ("COMPLETE", "RUN_COMPLETE.json")


def cache_folder(uri: str) -> Path:
    """This node's cache of the bucket store at `uri` (GHOSTVIS_STORE_CACHE, default ~/.cache/ghostvis/store)."""
    parsed = urllib.parse.urlparse(uri)
    default = Path.home() / ".cache" / "ghostvis" / "store"
    return (Path(os.environ.get("GHOSTVIS_STORE_CACHE") or default) / parsed.netloc / parsed.path.strip("/")).resolve()


class S3Store:
    """The store's objects live in `bucket` under `prefix`; `cache` is this node's local copy of those it opened."""

    def __init__(self, bucket: str, prefix: str, cache: Path):
        import boto3  # here, not at module level: an import every process would pay, S3 store or not

        self.bucket, self.prefix, self.cache = bucket, prefix.strip("/"), cache
        self.s3 = boto3.client("s3")

    @classmethod
    def from_uri(cls, uri: str) -> S3Store:
        parsed = urllib.parse.urlparse(uri)
        if not parsed.netloc:
            raise GhostvisError(f"artifact store {uri}: give the bucket, s3://bucket/prefix")
        return cls(parsed.netloc, parsed.path, cache_folder(uri))

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    @property
    def shared_folder(self) -> bool:
        return False

    def uri_of(self, kind: str, *key: str) -> str:
        return f"s3://{self.bucket}/{self.object_key(kind, *key)}"

    def object_key(self, kind: str, *key: str) -> str:
        return self._object(fill(kind, key))

    def exists(self, kind: str, *key: str) -> bool:
        return bool(self._objects(kind, *key))

    def keys(self, kind: str, *prefix: str) -> list[tuple[str, ...]]:
        """Oldest first; a folder artifact's time is its newest object's."""
        pattern = key_pattern(kind, prefix)
        found: dict[tuple[str, ...], Any] = {}
        base = listing_prefix(kind, prefix)
        for o in self._list(self._object(base + "/" if base else "")):
            parts = self._relative(o["Key"]).split("/")
            for n in range(1, len(parts) + 1):  # the object itself, or a folder holding it
                m = pattern.fullmatch("/".join(parts[:n]))
                if m and not parts[n - 1].startswith("."):
                    found[m.groups()] = max(found.get(m.groups(), o["LastModified"]), o["LastModified"])
        return [k for k, _ in sorted(found.items(), key=lambda kv: kv[1])]

    def delete(self, kind: str, *key: str) -> None:
        for o in self._objects(kind, *key):
            self.s3.delete_object(Bucket=self.bucket, Key=o["Key"])
        remove(self.cache / fill(kind, key))

    def read_text(self, kind: str, *key: str) -> str:
        from botocore.exceptions import ClientError  # loaded with boto3 by __init__

        try:
            return self.s3.get_object(Bucket=self.bucket, Key=self.object_key(kind, *key))["Body"].read().decode()
        except ClientError as exc:
            if exc.response["Error"]["Code"] in ("NoSuchKey", "404"):
                raise missing(kind, key, self.uri_of(kind, *key)) from None
            raise

    def read_json(self, kind: str, *key: str) -> Any:
        return json.loads(self.read_text(kind, *key))

    def write_text(self, kind: str, *key: str, text: str) -> str:
        """One PUT: readers see the old object or the new one."""
        self.s3.put_object(Bucket=self.bucket, Key=self.object_key(kind, *key), Body=text.encode())
        return self.uri_of(kind, *key)

    def write_json(self, kind: str, *key: str, data: Any) -> str:
        return self.write_text(kind, *key, text=json.dumps(data, indent=2, sort_keys=True))

    def create_json(self, kind: str, *key: str, data: Any) -> bool:
        """One conditional PUT (`If-None-Match: *`): S3 takes it only while no object has the key."""
        from botocore.exceptions import ClientError

        body = json.dumps(data, indent=2, sort_keys=True).encode()
        try:
            self.s3.put_object(Bucket=self.bucket, Key=self.object_key(kind, *key), Body=body, IfNoneMatch="*")
        except ClientError as exc:
            if exc.response["Error"]["Code"] in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                return False
            raise
        return True

    def put_file(self, kind: str, *key: str, src: Path) -> str:
        if not self.exists(kind, *key):
            self._upload(src, self.object_key(kind, *key))
        return self.uri_of(kind, *key)

    def fetch(self, kind: str, *key: str) -> Path:
        """Download the artifact (file or folder) into this node's cache where it is missing or differs."""
        objects = self._objects(kind, *key)
        if not objects:
            raise missing(kind, key, self.uri_of(kind, *key))
        for o in objects:
            dest = self.cache / self._relative(o["Key"])
            if not dest.exists() or dest.stat().st_size != o["Size"]:
                self._download(o["Key"], dest)
        return self.cache / fill(kind, key)

    def writable(self, kind: str, *key: str) -> Path:
        path = self.cache / fill(kind, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def publish(self, kind: str, *key: str) -> str:
        """Upload what this node wrote at writable(kind, key) that the bucket lacks; markers last."""
        local = self.cache / fill(kind, key)
        if not local.exists():
            raise GhostvisError(
                f"publish {kind} {'/'.join(key)}: nothing was written at {local}; write it at store.writable(...) first"
            )
        files = [local] if local.is_file() else [f for f in sorted(local.rglob("*")) if f.is_file()]
        files = [f for f in files if not _staging(f.relative_to(self.cache))]
        remote = {o["Key"]: o["Size"] for o in self._objects(kind, *key)}
        files.sort(key=lambda f: f.name in COMMIT_MARKERS)
        for f in files:
            name = self._object(f.relative_to(self.cache).as_posix())
            if remote.get(name) != f.stat().st_size:
                self._upload(f, name)
        return self.uri_of(kind, *key)

    def _object(self, relative: str) -> str:
        return f"{self.prefix}/{relative}" if self.prefix else relative

    def _relative(self, object_key: str) -> str:
        return object_key[len(self.prefix) + 1 :] if self.prefix else object_key

    def _list(self, object_prefix: str) -> list[dict[str, Any]]:
        """Objects under a key prefix (every page)."""
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=object_prefix)
        return [o for page in pages for o in page.get("Contents", [])]

    def _objects(self, kind: str, *key: str) -> list[dict[str, Any]]:
        """The one object of a file artifact, or every object inside a folder artifact."""
        name = self.object_key(kind, *key)
        return [o for o in self._list(name) if o["Key"] == name or o["Key"].startswith(name + "/")]

    def _upload(self, src: Path, name: str) -> None:
        self.s3.upload_file(str(src), self.bucket, name, ExtraArgs={"Metadata": {"sha256": sha256_file(src)}})

    def _download(self, name: str, dest: Path) -> None:
        """Download to a temporary name, check the uploader's sha256, then rename into the cache."""
        with replacing(dest) as tmp:
            self.s3.download_file(self.bucket, name, str(tmp))
            expected = self.s3.head_object(Bucket=self.bucket, Key=name).get("Metadata", {}).get("sha256")
            got = sha256_file(tmp)
            if expected and got != expected:
                raise TransferError(
                    f"s3://{self.bucket}/{name}: checksum mismatch after download (expected "
                    f"{expected}, got {got}); the object changed or the transfer was corrupted: "
                    "fetch it again, or re-materialize the asset that writes it"
                )


def _staging(rel: Path) -> bool:
    """A file still being written: in a hidden folder (`.tmp-step_…`) or a download's `.name.tmp-…`.
    Hidden files that are data (DCP's `.metadata`) are published."""
    return any(p.startswith(".") for p in rel.parts[:-1]) or (rel.name.startswith(".") and ".tmp-" in rel.name)

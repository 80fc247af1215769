"""The artifact store in an S3 bucket: GHOSTVIS_STORE=s3://bucket/prefix, on AWS or any S3-compatible
endpoint (AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL; credentials from the usual AWS environment).

Small records (manifests, run specs and records, markers) are read and written as objects. Files a
library opens are cached on each node under GHOSTVIS_STORE_CACHE (default ~/.cache/ghostvis/store)
in the store's own layout: `fetch()` downloads what is missing there, verified against the sha256
the uploader recorded, and `publish()` uploads what a node wrote, commit markers last, so a reader
never takes an interrupted upload for a complete artifact.
"""

from __future__ import annotations

import hashlib
import os
import re
import urllib.parse
import uuid
from pathlib import Path
from typing import Any

import boto3
from botocore.exceptions import ClientError

from ghostvis_core.errors import GhostvisError
from ghostvis_core.store import LAYOUT, LocalStore, fill, key_regex, known_kind

# files that say "everything beside me is complete": uploaded after everything else in their folder
COMMIT_MARKERS = ("COMPLETE", "RUN_COMPLETE.json")


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class S3Store(LocalStore):
    """The store's objects live in `bucket` under `prefix`; `root` is this node's cache of them."""

    def __init__(self, bucket: str, prefix: str, cache: Path):
        super().__init__(cache)
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.s3 = boto3.client("s3")

    @classmethod
    def from_uri(cls, uri: str) -> "S3Store":
        parsed = urllib.parse.urlparse(uri)
        if not parsed.netloc:
            raise GhostvisError(f"artifact store {uri}: give the bucket, s3://bucket/prefix")
        prefix = parsed.path.strip("/")
        default = Path.home() / ".cache" / "ghostvis" / "store"
        cache = Path(os.environ.get("GHOSTVIS_STORE_CACHE") or default) / parsed.netloc / prefix
        return cls(parsed.netloc, prefix, cache)

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def uri_of(self, kind: str, *key: str) -> str:
        return f"s3://{self.bucket}/{self.object_key(kind, *key)}"

    def object_key(self, kind: str, *key: str) -> str:
        return self._object(fill(kind, key))

    def _object(self, relative: str) -> str:
        return f"{self.prefix}/{relative}" if self.prefix else relative

    def _relative(self, object_key: str) -> str:
        return object_key[len(self.prefix) + 1:] if self.prefix else object_key

    def _list(self, object_prefix: str) -> list[dict[str, Any]]:
        """Objects under a key prefix (every page)."""
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=object_prefix)
        return [o for page in pages for o in page.get("Contents", [])]

    def _objects(self, kind: str, *key: str) -> list[dict[str, Any]]:
        """The one object of a file artifact, or every object inside a folder artifact."""
        name = self.object_key(kind, *key)
        return [o for o in self._list(name) if o["Key"] == name or o["Key"].startswith(name + "/")]

    def exists(self, kind: str, *key: str) -> bool:
        return bool(self._objects(kind, *key))

    def read_text(self, kind: str, *key: str) -> str:
        name = self.object_key(kind, *key)
        try:
            return self.s3.get_object(Bucket=self.bucket, Key=name)["Body"].read().decode()
        except ClientError as exc:
            if exc.response["Error"]["Code"] in ("NoSuchKey", "404"):
                raise GhostvisError(f"{kind} {'/'.join(key)} is not in the store (s3://{self.bucket}/{name}); "
                                    "materialize what writes it first") from None
            raise

    def write_text(self, kind: str, *key: str, text: str) -> Path:
        """One PUT: readers see the old object or the new one."""
        self.s3.put_object(Bucket=self.bucket, Key=self.object_key(kind, *key), Body=text.encode())
        return self.path(kind, *key)

    def put_file(self, kind: str, *key: str, src: Path) -> Path:
        """Upload a finished local file; an existing artifact is kept (same key, same content)."""
        if not self.exists(kind, *key):
            self._upload(src, self.object_key(kind, *key))
        return self.path(kind, *key)

    def delete(self, kind: str, *key: str) -> None:
        for o in self._objects(kind, *key):
            self.s3.delete_object(Bucket=self.bucket, Key=o["Key"])
        super().delete(kind, *key)

    def keys(self, kind: str, *prefix: str) -> list[tuple[str, ...]]:
        """Keys of stored artifacts of `kind` starting with `prefix`, oldest first (folders: their
        newest object's time)."""
        template = LAYOUT[known_kind(kind)]
        fixed = template.split("{")[0].rsplit("/", 1)[0] if "{" in template else template
        pattern = re.compile(key_regex(template, prefix))
        found: dict[tuple[str, ...], Any] = {}
        for o in self._list(self._object(fixed + "/")):
            parts = self._relative(o["Key"]).split("/")
            for n in range(1, len(parts) + 1):  # the object itself, or a folder holding it
                m = pattern.fullmatch("/".join(parts[:n]))
                if m and not parts[n - 1].startswith("."):
                    found[m.groups()] = max(found.get(m.groups(), o["LastModified"]), o["LastModified"])
        return [k for k, _ in sorted(found.items(), key=lambda kv: kv[1])]

    def fetch(self, kind: str, *key: str) -> Path:
        """Download the artifact (file or folder) into this node's cache where it is missing or differs."""
        for o in self._objects(kind, *key):
            dest = self.root / self._relative(o["Key"])
            if not dest.exists() or dest.stat().st_size != o["Size"]:
                self._download(o["Key"], dest)
        return self.path(kind, *key)

    def publish(self, kind: str, *key: str) -> None:
        """Upload what this node wrote at path(kind, key) that the bucket lacks; markers last."""
        local = self.path(kind, *key)
        files = [local] if local.is_file() else [f for f in sorted(local.rglob("*")) if f.is_file()]
        files = [f for f in files if not _staging(f.relative_to(self.root))]
        remote = {o["Key"]: o["Size"] for o in self._objects(kind, *key)}
        files.sort(key=lambda f: f.name in COMMIT_MARKERS)
        for f in files:
            name = self._object(f.relative_to(self.root).as_posix())
            if remote.get(name) != f.stat().st_size:
                self._upload(f, name)

    def _upload(self, src: Path, name: str) -> None:
        self.s3.upload_file(str(src), self.bucket, name, ExtraArgs={"Metadata": {"sha256": sha256_of(src)}})

    def _download(self, name: str, dest: Path) -> None:
        """Download to a temporary name, check the uploader's sha256, then rename into the cache."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.tmp-{uuid.uuid4().hex[:8]}")
        self.s3.download_file(self.bucket, name, str(tmp))
        expected = self.s3.head_object(Bucket=self.bucket, Key=name).get("Metadata", {}).get("sha256")
        got = sha256_of(tmp)
        if expected and got != expected:
            tmp.unlink(missing_ok=True)
            raise GhostvisError(f"s3://{self.bucket}/{name}: checksum mismatch after download (expected {expected}, "
                                f"got {got}); the object changed or the transfer was corrupted: fetch it again, "
                                "or re-materialize the asset that writes it")
        os.replace(tmp, dest)


def _staging(rel: Path) -> bool:
    """A file still being written: in a hidden folder (`.tmp-step_…`) or a download's `.name.tmp-…`.
    Hidden files that are data (DCP's `.metadata`) are published."""
    return any(p.startswith(".") for p in rel.parts[:-1]) or (rel.name.startswith(".") and ".tmp-" in rel.name)

"""The artifact store: where every artifact lives, addressed by kind and key, never by a hand-built path.

Every read and write of shards, tokenizers, checkpoints, run specs and records, ledger tables and
reports names an artifact kind (a key of `LAYOUT`) and its key parts. `LocalStore` keeps them in a
folder (GHOSTVIS_HOME/store by default, or GHOSTVIS_STORE); a shared filesystem is the same folder
mounted on every node. `S3Store` keeps them in a bucket (GHOSTVIS_STORE=s3://bucket/prefix, any
S3-compatible endpoint) and caches what a node opens in a local folder with the same layout.

Libraries that need a file (safetensors, DuckDB, datatrove) get one from `fetch()` (reads) or
`path()` followed by `publish()` (writes); on a local store both are the store's own file. Where an
artifact lives never changes what it is (docs/invariants.md, invariant 7): the key is the identity.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import urllib.parse
import uuid
from pathlib import Path
from typing import Any

from ghostvis_core.errors import GhostvisError

# kind -> location under the store root. `{}` is one key part (no "/"); `{path}` may hold "/"
# (shard ids are <source>/<shard>).
LAYOUT: dict[str, str] = {
    "manifest": "manifests/{}.json",  # source
    "raw_shard": "shards/raw/{path}.parquet",  # shard_id
    "raw_shard_meta": "shards/raw_meta/{path}.json",  # shard_id: sha256, bytes, split of the downloaded shard
    "tokenizer": "tokenizers/{}",  # tokenizer_id: a folder (tokenizer.json, ...)
    "token_shard": "shards/tokens/{}/{path}.arrow",  # tokenizer_id, shard_id
    "ledger": "ledger",  # the ledger's Parquet tables (data/ledger.py)
    "ledger_file": "ledger/{path}",  # one file of those tables, by its path inside the ledger
    "checkpoints": "checkpoints/{}/{}",  # stage, run_key: the run's step_* folders
    "checkpoint": "checkpoints/{}/{}/{}",  # stage, run_key, step_* folder: one checkpoint
    "checkpoint_marker": "checkpoints/{}/{}/{}/COMPLETE",  # stage, run_key, step_*: written last, when committed
    "run_record": "checkpoints/{}/{}/RUN_COMPLETE.json",  # stage, run_key: the finished run's RunResult
    "run_spec": "runs/{}/{}/spec.json",  # stage, run_key: the LaunchSpec the ranks read
    "run_error": "runs/{}/{}/error.txt",  # stage, run_key: a failed run's one-line reason
    "run_file": "runs/{}/{}/{path}",  # stage, run_key, name: a launcher's file (job script, job output, Pipes messages)
    "report": "reports/{path}",  # file name under reports/
    "identity": "identities/{}/{path}.json",  # asset, key: what an artifact is made of (ghostvis_core/identity.py)
}


class LocalStore:
    """The artifact store as a local (or shared, mounted) folder."""

    def __init__(self, root: Path | str):
        self.root = Path(root).expanduser().resolve()

    @property
    def uri(self) -> str:
        return self.root.as_uri()

    def path(self, kind: str, *key: str) -> Path:
        """The file or folder that holds artifact (kind, key)."""
        return self.root / fill(kind, key)

    def exists(self, kind: str, *key: str) -> bool:
        return self.path(kind, *key).exists()

    def read_text(self, kind: str, *key: str) -> str:
        path = self.path(kind, *key)
        if not path.exists():
            raise GhostvisError(f"{kind} {'/'.join(key)} is not in the store ({path}); materialize what writes it first")
        return path.read_text()

    def read_json(self, kind: str, *key: str) -> Any:
        return json.loads(self.read_text(kind, *key))

    def write_text(self, kind: str, *key: str, text: str) -> Path:
        """Atomic: readers see the old file or the new one, never half of it."""
        path = self.path(kind, *key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
        tmp.write_text(text)
        os.replace(tmp, path)
        return path

    def write_json(self, kind: str, *key: str, data: Any) -> Path:
        return self.write_text(kind, *key, text=json.dumps(data, indent=2, sort_keys=True))

    def put_file(self, kind: str, *key: str, src: Path) -> Path:
        """Copy a finished local file in (atomically); an existing artifact is kept (same key, same content)."""
        path = self.path(kind, *key)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
            shutil.copyfile(src, tmp)
            os.replace(tmp, path)
        return path

    def uri_of(self, kind: str, *key: str) -> str:
        """Where artifact (kind, key) lives, for people and metadata."""
        return str(self.path(kind, *key))

    def fetch(self, kind: str, *key: str) -> Path:
        """The local file or folder holding artifact (kind, key), for a library to open."""
        return self.path(kind, *key)

    def publish(self, kind: str, *key: str) -> None:
        """Make what was written at `path(kind, key)` visible to every node (here it already is)."""

    def delete(self, kind: str, *key: str) -> None:
        path = self.path(kind, *key)
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)

    def keys(self, kind: str, *prefix: str) -> list[tuple[str, ...]]:
        """Keys of the stored artifacts of `kind` whose key starts with `prefix`, oldest first."""
        template = LAYOUT[known_kind(kind)]
        fixed = template.split("{")[0].rsplit("/", 1)[0] if "{" in template else template
        base = self.root / fixed
        if not base.exists():
            return []
        pattern = re.compile(key_regex(template, prefix))
        found = []
        for p in base.rglob("*"):
            m = pattern.fullmatch(p.relative_to(self.root).as_posix())
            if m and not p.name.startswith("."):
                found.append((p.stat().st_mtime, m.groups()))
        return [k for _, k in sorted(found)]


def open_store(uri: str) -> LocalStore:
    """The store at a URI or path (what a launch spec carries to every rank)."""
    if uri.startswith("s3://"):
        from ghostvis_core.s3_store import S3Store

        return S3Store.from_uri(uri)
    if uri.startswith("file://"):
        return LocalStore(Path(urllib.parse.unquote(urllib.parse.urlparse(uri).path)))
    if "://" in uri:
        raise GhostvisError(f"artifact store {uri}: give a folder (local, or a shared filesystem mounted on every "
                            "node) or s3://bucket/prefix")
    return LocalStore(Path(uri))


def known_kind(kind: str) -> str:
    if kind not in LAYOUT:
        raise GhostvisError(f"unknown artifact kind '{kind}'; kinds: {', '.join(LAYOUT)}")
    return kind


def fill(kind: str, key: tuple[str, ...]) -> str:
    template = LAYOUT[known_kind(kind)]
    slots = template.count("{")
    if len(key) != slots:
        raise GhostvisError(f"artifact kind '{kind}' takes {slots} key part(s), got {list(key)}")
    for part in key:
        if not part or part.startswith(".") or "/../" in f"/{part}/":
            raise GhostvisError(f"artifact {kind}: invalid key part {part!r}")
    return template.replace("{path}", "{}").format(*key)


def key_regex(template: str, prefix: tuple[str, ...]) -> str:
    out, given = "", list(prefix)
    for chunk in re.split(r"(\{path\}|\{\})", template):
        if chunk in ("{}", "{path}"):
            out += f"({re.escape(given.pop(0))})" if given else ("(.+)" if chunk == "{path}" else "([^/]+)")
        else:
            out += re.escape(chunk)
    return out

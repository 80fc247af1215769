"""The artifact store as a folder: local, or a shared filesystem mounted at the same place on every node."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from ghostvis_core.errors import GhostvisError
from ghostvis_core.store.files import atomic_write, remove, replacing
from ghostvis_core.store.layout import fill, key_pattern, listing_prefix


class FolderStore:
    """Artifacts are files and folders under `root`; `writable` is the artifact's own place, so `publish`
    has nothing to copy. Artifacts are named by their absolute path (what existing homes' records hold)."""

    def __init__(self, root: Path | str):
        self.root = Path(root).expanduser().resolve()

    @property
    def uri(self) -> str:
        return self.root.as_uri()

    @property
    def shared_folder(self) -> bool:
        return True

    def uri_of(self, kind: str, *key: str) -> str:
        return str(self.root / fill(kind, key))

    def exists(self, kind: str, *key: str) -> bool:
        return (self.root / fill(kind, key)).exists()

    def keys(self, kind: str, *prefix: str) -> list[tuple[str, ...]]:
        base = self.root / listing_prefix(kind, prefix)
        if not base.is_dir():
            return []
        pattern = key_pattern(kind, prefix)
        found = []
        # os.walk, not rglob: a run folder renamed or pruned while we list (a checkpoint committing) is
        # skipped, not an error
        for folder, dirs, files in os.walk(base):
            for name in (*dirs, *files):
                p = Path(folder) / name
                m = pattern.fullmatch(p.relative_to(self.root).as_posix())
                if m and not name.startswith("."):
                    try:
                        found.append((p.stat().st_mtime, m.groups()))
                    except FileNotFoundError:
                        continue
        return [k for _, k in sorted(found)]

    def delete(self, kind: str, *key: str) -> None:
        remove(self.root / fill(kind, key))

    def read_text(self, kind: str, *key: str) -> str:
        return self.fetch(kind, *key).read_text()

    def read_json(self, kind: str, *key: str) -> Any:
        return json.loads(self.read_text(kind, *key))

    def write_text(self, kind: str, *key: str, text: str) -> str:
        atomic_write(self.root / fill(kind, key), text)
        return self.uri_of(kind, *key)

    def write_json(self, kind: str, *key: str, data: Any) -> str:
        return self.write_text(kind, *key, text=json.dumps(data, indent=2, sort_keys=True))

    def create_json(self, kind: str, *key: str, data: Any) -> bool:
        """A finished temporary file hard-linked onto the name: link(2) fails if the name exists, on a local
        or NFS filesystem alike, and a reader never sees a half-written record."""
        path = self.root / fill(kind, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
            os.link(tmp, path)
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)
        return True

    def put_file(self, kind: str, *key: str, src: Path) -> str:
        path = self.root / fill(kind, key)
        if not path.exists():
            with replacing(path) as tmp:
                shutil.copyfile(src, tmp)
        return self.uri_of(kind, *key)

    def fetch(self, kind: str, *key: str) -> Path:
        path = self.root / fill(kind, key)
        if not path.exists():
            raise missing(kind, key, str(path))
        return path

    def writable(self, kind: str, *key: str) -> Path:
        path = self.root / fill(kind, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def publish(self, kind: str, *key: str) -> str:
        """Already visible where it was written; checks that something was."""
        self.fetch(kind, *key)
        return self.uri_of(kind, *key)


def missing(kind: str, key: tuple[str, ...], where: str) -> GhostvisError:
    """The error for an artifact that is not in the store: what it is, where it was looked for, and the fix."""
    return GhostvisError(
        f"{kind} {'/'.join(key)} is not in the store ({where}); materialize the asset that writes it first"
    )

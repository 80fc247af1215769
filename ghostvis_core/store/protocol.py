"""What every artifact store offers: artifacts addressed by kind (a key of LAYOUT) and key parts.

No method hands out a local path to something that is not there. Writes return the artifact's URI;
a local copy of an existing artifact comes only from `fetch`; a library that must write a file itself
gets a local place from `writable` and makes the result visible to every node with `publish`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol


class Store(Protocol):
    @property
    def uri(self) -> str:
        """The store itself: an absolute folder path, file:///... or s3://bucket/prefix."""
        ...

    @property
    def shared_folder(self) -> bool:
        """True when every node writes into the store's own folder (a local or shared filesystem): what a
        node wrote at `writable` is already in the store. False: each node has its own copy to upload."""
        ...

    def uri_of(self, kind: str, *key: str) -> str:
        """Where artifact (kind, key) lives, for people, metadata and records (its key is in it)."""
        ...

    def exists(self, kind: str, *key: str) -> bool: ...

    def keys(self, kind: str, *prefix: str) -> list[tuple[str, ...]]:
        """Keys of the stored artifacts of `kind` whose key starts with `prefix`, oldest first."""
        ...

    def delete(self, kind: str, *key: str) -> None: ...

    def read_text(self, kind: str, *key: str) -> str: ...

    def read_json(self, kind: str, *key: str) -> Any: ...

    def write_text(self, kind: str, *key: str, text: str) -> str:
        """Atomic (readers see the old artifact or the new one); returns the artifact's URI."""
        ...

    def write_json(self, kind: str, *key: str, data: Any) -> str: ...

    def create_json(self, kind: str, *key: str, data: Any) -> bool:
        """Write the artifact only if it does not exist yet, atomically against every other writer on any node
        (the one compare-and-set the store offers: leases are built on it); False when it already existed."""
        ...

    def put_file(self, kind: str, *key: str, src: Path) -> str:
        """Store a finished local file; an existing artifact is kept (same key, same content). Returns its URI."""
        ...

    def fetch(self, kind: str, *key: str) -> Path:
        """A local copy of an existing artifact (file or folder) for a library to open; a missing one is an
        error naming it."""
        ...

    def writable(self, kind: str, *key: str) -> Path:
        """A local place (its parent folder made) where a library writes artifact (kind, key); nobody else
        sees it until `publish`."""
        ...

    def publish(self, kind: str, *key: str) -> str:
        """Make what was written at `writable(kind, key)` visible to every node; returns its URI."""
        ...

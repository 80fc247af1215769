"""The code base's one atomic write, one file hash and one removal of a stored key's file or folder.

Readers (other ranks, other nodes, a crashed run's successor) must see a file whole or not at all, so
every file the code base writes for others is written through `atomic_write` (bytes or text in hand),
or `replacing` (a library or a download writes the file itself); every content hash of a file (shard
pins, upload checksums, audit recounts) is `sha256_file`, so two hashes of the same bytes agree; a key's
file or folder (in a folder store, in an S3 store's local cache) goes with `remove`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A hidden temporary file beside `path` to write; renamed onto `path` when the block ends without an
    error (same filesystem, so readers see the old file or the new one), removed when it raises. The
    parent folder is made. The store never lists nor publishes the temporary name (`.<name>.tmp-…`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write(path: Path, data: bytes | str) -> Path:
    """Write `data` to `path` whole or not at all."""
    with replacing(path) as tmp:
        if isinstance(data, str):
            tmp.write_text(data)
        else:
            tmp.write_bytes(data)
    return path


def sha256_file(path: Path) -> str:
    """The hex sha256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def remove(path: Path) -> None:
    """Delete a key's local copy, a folder (a checkpoint) or a file, whichever it is; a missing one is no error."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)

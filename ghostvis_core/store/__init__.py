"""The artifact store: where every artifact lives, addressed by kind and key, never by a hand-built path.

Every read and write of shards, tokenizers, checkpoints, run specs and records, ledger tables and
reports names an artifact kind (a key of `LAYOUT`) and its key parts. `FolderStore` keeps them in a
folder (GHOSTVIS_HOME/store by default, or GHOSTVIS_STORE); a shared filesystem is the same folder
mounted on every node. `S3Store` keeps them in a bucket (GHOSTVIS_STORE=s3://bucket/prefix) and
caches what a node opens in a local folder with the same layout. Both are a `Store` (protocol.py).
Where an artifact lives never changes what it is (docs/invariants.md, invariant 7): the key is the identity.
"""

from __future__ import annotations

import os
import urllib.parse
from pathlib import Path

from ghostvis_core.errors import GhostvisError
from ghostvis_core.store.folder import FolderStore
from ghostvis_core.store.layout import LAYOUT
from ghostvis_core.store.protocol import Store
from ghostvis_core.store.s3 import S3Store, cache_folder

__all__ = ["LAYOUT", "FolderStore", "S3Store", "Store", "open_store"]

# one store object per store per process: a bucket store holds a boto3 client, and every caller of the
# same store shares it (keyed by what the object is made of, so a changed cache folder or endpoint is a new
# store). A forked child (a tokenizer worker) opens its own: a client's connections are not shared across a fork.
_OPEN: dict[tuple[str, ...], Store] = {}


def open_store(uri: str) -> Store:
    """The store at a URI or path (what a launch spec carries to every rank): the same object on every call."""
    identity = (str(os.getpid()), *store_identity(uri))
    if identity not in _OPEN:
        _OPEN[identity] = S3Store.from_uri(uri) if identity[1] == "s3" else FolderStore(identity[2])
    return _OPEN[identity]


def store_identity(uri: str) -> tuple[str, ...]:
    """What makes two store URIs the same store object: the folder; or the bucket URI, this node's cache and
    the S3 endpoint."""
    if uri.startswith("s3://"):
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or ""
        return ("s3", uri.rstrip("/"), str(cache_folder(uri)), endpoint)
    if uri.startswith("file://"):
        return ("folder", str(Path(urllib.parse.unquote(urllib.parse.urlparse(uri).path)).expanduser().resolve()))
    if "://" in uri:
        raise GhostvisError(
            f"artifact store {uri}: give a folder (local, or a shared filesystem mounted on every "
            "node) or s3://bucket/prefix"
        )
    return ("folder", str(Path(uri).expanduser().resolve()))

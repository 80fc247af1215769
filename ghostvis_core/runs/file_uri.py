"""A run's files by URI: `<store>/runs/<stage>/<run_key>/<name>` (the spec, a launcher's job script,
nodes.sh, manifests), read from any store, so that a node or a person holding only the URI that a
launcher logged can fetch the file (`ghostvis store cat <uri>`)."""

from __future__ import annotations

from ghostvis_core.errors import GhostvisError
from ghostvis_core.store import open_store


def split_run_uri(uri: str) -> tuple[str, str, str, str]:
    """(store URI, stage, run key, name) of `<store>/runs/<stage>/<run_key>/<name>`."""
    store_uri, _, rest = uri.rpartition("/runs/")
    parts = rest.split("/", 2)
    if not store_uri or len(parts) != 3 or not all(parts):
        raise GhostvisError(
            f"{uri}: expected a run's file, <store>/runs/<stage>/<run_key>/<name> (a folder or "
            "s3://bucket/prefix store), as a launcher logs it"
        )
    return store_uri, parts[0], parts[1], parts[2]


def read_run_file(uri: str) -> str:
    """The text of the run file at `uri`, from its store (a bucket through this node's credentials)."""
    store_uri, stage, run_key, name = split_run_uri(uri)
    return open_store(store_uri).read_text("run_file", stage, run_key, name)

"""Dagster Pipes for ranks on other machines: rank 0 writes its messages into the run's folder in the
shared store (a file on a shared filesystem, or objects in the store's bucket), and the launcher on
the Dagster host reads them from there."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from dagster import (
    AssetExecutionContext, PipesEnvContextInjector, PipesFileMessageReader, PipesMessageReader, open_pipes_session,
)

from ghostvis_core.home import Home
from ghostvis_core.s3_store import S3Store
from ghostvis_core.train.spec import LaunchSpec


def store_message_reader(home: Home, spec: LaunchSpec, attempt: str) -> PipesMessageReader:
    """Messages through the store: S3 objects (rank 0 picks the S3 writer from the bootstrap
    parameters) or a file in the run's folder (`run_file` pipes/<attempt>.jsonl)."""
    store = home.store
    if isinstance(store, S3Store):
        from dagster_aws.pipes import PipesS3MessageReader

        return PipesS3MessageReader(bucket=store.bucket, client=store.s3, interval=2)
    path = store.path("run_file", spec.stage, spec.run_key, f"pipes/{attempt}.jsonl")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    return PipesFileMessageReader(str(path), include_stdio_in_messages=False)


@contextmanager
def store_pipes_session(context: AssetExecutionContext, home: Home, spec: LaunchSpec, attempt: str) -> Iterator:
    """A Pipes session whose messages travel through the store. Pass `session.get_bootstrap_env_vars()`
    to the job's environment; the messages arrive as the session runs and when it closes."""
    reader = store_message_reader(home, spec, attempt)
    with open_pipes_session(context, PipesEnvContextInjector(), reader) as session:
        yield session

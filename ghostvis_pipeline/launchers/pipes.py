"""Dagster Pipes for ranks on other machines: rank 0 writes its messages into the run's folder in the
shared store, and the launcher on the Dagster host reads them from there."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from dagster import AssetExecutionContext, PipesEnvContextInjector, PipesFileMessageReader, open_pipes_session

from ghostvis_core.home import Home
from ghostvis_core.train.spec import LaunchSpec


@contextmanager
def store_pipes_session(context: AssetExecutionContext, home: Home, spec: LaunchSpec, attempt: str) -> Iterator:
    """A Pipes session whose messages travel through the store (`run_file` pipes/<attempt>.jsonl).
    Pass `session.get_bootstrap_env_vars()` to the job's environment; the messages arrive as the
    session runs and when it closes."""
    path = home.store.path("run_file", spec.stage, spec.run_key, f"pipes/{attempt}.jsonl")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    reader = PipesFileMessageReader(str(path), include_stdio_in_messages=False)
    with open_pipes_session(context, PipesEnvContextInjector(), reader) as session:
        yield session

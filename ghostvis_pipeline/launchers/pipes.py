"""Dagster Pipes for ranks on any machine: rank 0 writes its messages as numbered chunks into the run's
folder in the store (`run_file` pipes/<attempt>/<n>.json, ghostvis_core/run/track/pipes.py), and the
launcher on the Dagster host reads them from there, whatever the store is (a folder, a shared
filesystem or a bucket)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from dagster import AssetExecutionContext, PipesBlobStoreMessageReader, PipesEnvContextInjector, open_pipes_session

from ghostvis_core.home import Home
from ghostvis_core.run.track.pipes import (
    ATTEMPT_PARAM,
    CHUNK_INTERVAL_S,
    RUN_KEY_PARAM,
    STAGE_PARAM,
    STORE_PARAM,
    chunk_name,
)
from ghostvis_core.runs.job_command import Job
from ghostvis_core.store import Store
from ghostvis_pipeline.launchers.common import clear_reason, job_env


class StoreMessageReader(PipesBlobStoreMessageReader):
    """Reads one launch attempt's message chunks from the store, in order, as they appear."""

    def __init__(self, store: Store, target: Job, attempt: str):
        super().__init__(interval=CHUNK_INTERVAL_S)
        self.store, self.stage, self.run_key, self.attempt = store, target.stage, target.run_key, attempt

    @contextmanager
    def get_params(self) -> Iterator[dict]:
        yield {
            STORE_PARAM: self.store.uri,
            STAGE_PARAM: self.stage,
            RUN_KEY_PARAM: self.run_key,
            ATTEMPT_PARAM: self.attempt,
        }

    def messages_are_readable(self, params: dict) -> bool:
        return self.store.exists("run_file", self.stage, self.run_key, chunk_name(self.attempt, 1))

    def download_messages_chunk(self, index: int, params: dict) -> str | None:
        name = chunk_name(self.attempt, index)
        if not self.store.exists("run_file", self.stage, self.run_key, name):
            return None
        return self.store.read_text("run_file", self.stage, self.run_key, name)

    def no_messages_debug_text(self) -> str:
        first = self.store.uri_of("run_file", self.stage, self.run_key, chunk_name(self.attempt, 1))
        return f"no Pipes messages at {first}: rank 0 writes them there once it runs and reaches the store"


@contextmanager
def store_pipes_session(context: AssetExecutionContext, home: Home, target: Job, attempt: str) -> Iterator:
    """A Pipes session whose messages travel through the store. Pass `session.get_bootstrap_env_vars()`
    to the job's environment; the messages arrive as the session runs and when it closes."""
    reader = StoreMessageReader(home.store, target, attempt)
    with open_pipes_session(context, PipesEnvContextInjector(), reader) as session:
        yield session


@contextmanager
def job_session(
    context: AssetExecutionContext, home: Home, target: Job, attempt: str, launcher, nproc: int, cpus: int | None = None
) -> Iterator[dict[str, str]]:
    """What the process launchers (local, torchrun, slurm) start their job inside: the run's last failure reason
    cleared, a store Pipes session open, and the job's environment (the profile's job variables and the session's
    bootstrap ones) yielded; the session's last messages arrive when it closes."""
    clear_reason(home, target)
    with store_pipes_session(context, home, target, attempt) as session:
        yield {**job_env(launcher.profile, nproc, cpus), **session.get_bootstrap_env_vars()}

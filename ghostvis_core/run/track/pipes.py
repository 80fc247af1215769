"""The one bridge to Dagster: rank 0 reports through Dagster Pipes when launched by Dagster.

Messages travel through the artifact store, whatever the store is (a folder, a shared filesystem or
a bucket): rank 0 writes numbered chunks as `run_file` pipes/<attempt>/<n>.json and the launcher on the
Dagster host reads them (ghostvis_pipeline/launchers/pipes.py), so rank 0 may run on any node that
can reach the store. Under plain torchrun (no Pipes variables in the environment) every call is a
no-op, so the training script never branches on who started it.
"""

from __future__ import annotations

from typing import IO, Any

from dagster_pipes import (
    PipesBlobStoreMessageWriter,
    PipesBlobStoreMessageWriterChannel,
    PipesEnvVarParamsLoader,
    open_dagster_pipes,
)

from ghostvis_core.store import open_store

# The params the launcher's reader gives the writer (one owner for both ends).
STORE_PARAM, STAGE_PARAM, RUN_KEY_PARAM, ATTEMPT_PARAM = "store", "stage", "run_key", "attempt"
CHUNK_INTERVAL_S = 1  # dagster_pipes uploads when more than this many whole seconds have passed


def chunk_name(attempt: str, index: int) -> str:
    """The `run_file` name of one attempt's message chunk `index` (counted from 1, as Pipes does)."""
    return f"pipes/{attempt}/{index}.json"


class StoreMessageWriterChannel(PipesBlobStoreMessageWriterChannel):
    """Uploads each chunk of messages as one object of the run's folder in the store."""

    def __init__(self, params: dict[str, Any], interval: float):
        super().__init__(interval=interval)
        self._store = open_store(params[STORE_PARAM])
        self._where = (params[STAGE_PARAM], params[RUN_KEY_PARAM], params[ATTEMPT_PARAM])

    def upload_messages_chunk(self, payload: IO, index: int) -> None:
        stage, run_key, attempt = self._where
        self._store.write_text("run_file", stage, run_key, chunk_name(attempt, index), text=payload.read())


class StoreMessageWriter(PipesBlobStoreMessageWriter):
    def make_channel(self, params: dict[str, Any]) -> StoreMessageWriterChannel:
        return StoreMessageWriterChannel(params, self.interval)


class PipesReporter:
    def __init__(self, is_main: bool):
        self._ctx = None
        loader = PipesEnvVarParamsLoader()
        if is_main and loader.is_dagster_pipes_process():
            self._ctx = open_dagster_pipes(message_writer=StoreMessageWriter(interval=CHUNK_INTERVAL_S))

    def log(self, message: str) -> None:
        if self._ctx is not None:
            self._ctx.log.info(message)

    def report_materialization(self, metadata: dict[str, Any]) -> None:
        if self._ctx is not None:
            self._ctx.report_asset_materialization(metadata=metadata)

    def close(self) -> None:
        if self._ctx is not None:
            self._ctx.close()
            self._ctx = None

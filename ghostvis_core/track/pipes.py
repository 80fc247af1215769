"""The one bridge to Dagster: rank 0 reports through Dagster Pipes when launched by Dagster.

Under plain torchrun (no Pipes variables in the environment) every call is a no-op, so the
training script never branches on who started it.
"""

from __future__ import annotations

from typing import Any

from dagster_pipes import PipesEnvVarParamsLoader, open_dagster_pipes


class PipesReporter:
    def __init__(self, is_main: bool):
        self._ctx = None
        if is_main and PipesEnvVarParamsLoader().is_dagster_pipes_process():
            self._ctx = open_dagster_pipes()

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

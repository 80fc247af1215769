"""The one bridge to Dagster: rank 0 reports through Dagster Pipes when launched by Dagster.

Under plain torchrun (no Pipes variables in the environment) every call is a no-op, so the
training script never branches on who started it.
"""

from __future__ import annotations

from typing import Any

from dagster_pipes import PipesDefaultMessageWriter, PipesEnvVarParamsLoader, PipesS3MessageWriter, open_dagster_pipes


def message_writer(params: dict[str, Any]):
    """The launcher's channel: S3 objects when it gave a bucket (ranks on other machines, store in S3),
    else Dagster's default (a file or stdio)."""
    if "bucket" in params:
        import boto3

        return PipesS3MessageWriter(client=boto3.client("s3"), interval=2)
    return PipesDefaultMessageWriter()


class PipesReporter:
    def __init__(self, is_main: bool):
        self._ctx = None
        loader = PipesEnvVarParamsLoader()
        if is_main and loader.is_dagster_pipes_process():
            self._ctx = open_dagster_pipes(message_writer=message_writer(loader.load_messages_params()))

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

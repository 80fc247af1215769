"""The `export_model` job: export a stage's trained model as a Hugging Face checkpoint from the UI
(Launchpad: stage, optional run_key, destination folder)."""

from typing import Optional

from dagster import Config, Failure, MetadataValue, OpExecutionContext, job, op

from ghostvis_core.errors import GhostvisError
from ghostvis_pipeline.resources import GhostvisHome


class ExportConfig(Config):
    stage: str
    to: str
    run_key: Optional[str] = None  # None: the stage's newest completed run


@op
def export_stage(context: OpExecutionContext, config: ExportConfig, home: GhostvisHome) -> str:
    from ghostvis_core.run.hf.export import export_run

    try:
        out = export_run(home.home(), config.stage, config.run_key, config.to)
    except GhostvisError as exc:
        raise Failure(description=str(exc), allow_retries=False) from None
    context.add_output_metadata({"path": MetadataValue.path(str(out)),
                                 "files": MetadataValue.json(sorted(p.name for p in out.iterdir()))})
    return str(out)


@job(description="Export a trained stage as a Hugging Face checkpoint (config: stage, to, optional run_key)")
def export_model():
    export_stage()

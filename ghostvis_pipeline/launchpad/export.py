"""The `export_model` job: export a stage's trained model as a Hugging Face checkpoint from the UI
(Launchpad: stage, optional run_key, destination folder). The export loads the checkpoint and
transformers, so it runs in a process of its own (`python -m ghostvis_core.run.hf.export`), never in
the Dagster process."""

import subprocess
import sys
from pathlib import Path

from dagster import Config, Failure, MetadataValue, OpExecutionContext, job, op

from ghostvis_pipeline.resources import GhostvisHome


class ExportConfig(Config):
    stage: str
    to: str
    run_key: str | None = None  # None: the stage's newest completed run


def export_in_subprocess(store_uri: str, config: ExportConfig, summary: Path | None = None) -> Path:
    """The exported folder, written by `python -m ghostvis_core.run.hf.export` (its refusal as a Failure);
    `summary`: the home's summary.yaml, for the model card's licence fields."""
    argv = [
        sys.executable,
        "-m",
        "ghostvis_core.run.hf.export",
        "--store",
        store_uri,
        "--stage",
        config.stage,
        "--to",
        config.to,
        *(["--run-key", config.run_key] if config.run_key else []),
        *(["--summary", str(summary)] if summary and summary.is_file() else []),
    ]
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        told = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit code {proc.returncode}"
        raise Failure(description=f"export of {config.stage}: {told.removeprefix('error: ')}", allow_retries=False)
    return Path(proc.stdout.strip().splitlines()[-1])


@op
def export_stage(context: OpExecutionContext, config: ExportConfig, home: GhostvisHome) -> str:
    from ghostvis_core.run.hf.summary_input import SUMMARY_FILE

    ghostvis_home = home.home()
    out = export_in_subprocess(ghostvis_home.store.uri, config, ghostvis_home.root / SUMMARY_FILE)
    context.add_output_metadata(
        {"path": MetadataValue.path(str(out)), "files": MetadataValue.json(sorted(p.name for p in out.iterdir()))}
    )
    return str(out)


@job(description="Export a trained stage as a Hugging Face checkpoint (config: stage, to, optional run_key)")
def export_model():
    export_stage()

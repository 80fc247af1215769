"""Register a finished stage run's model in MLflow where the checkpoint is, not where Dagster runs: the
training job does it on rank 0 once training returned (ghostvis_core/run/__main__.py), and for a run whose
job did not (a cache hit, which only points the stage's alias back at its version; a job whose registry
was down) the stage asset launches `python -m ghostvis_core.run.hf.register --spec URI --tracking-uri URI`
as a job of its own, through the same launcher as training. Loading the checkpoint, exporting it and
MLflow's model logging (transformers) stay out of the Dagster process.

The outcome, with the process that produced it, is kept beside the run as
`runs/<stage>/<run_key>/registered_model.json` (model_record): {"pid", "host", "tracking_uri",
"model_uri", "version", "created", "checks", "seconds"}, or {"pid", "host", "tracking_uri", "error"} when
MLflow could not take it: the run stands, and the next materialization of the stage registers it.
"checks" is the verdict of the run's blocking checks the version was marked with (run/track/check_verdict.py):
`pending` when the training job registers it, as Dagster checks the run only after the job; the checks then
mark the version passed (the stage's alias moves to it) or failed (no alias).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

from ghostvis_core.data.ledger import Ledger
from ghostvis_core.exit import skip_final_collections
from ghostvis_core.plan.stages import stage_names
from ghostvis_core.run.hf.manifest import build_manifest, manifest_sha256
from ghostvis_core.run.track.check_verdict import run_verdict
from ghostvis_core.run.track.mlflow_models import StageModel, register_stage_model
from ghostvis_core.run.track.pipes import PipesReporter
from ghostvis_core.runs.file_uri import split_run_uri
from ghostvis_core.runs.job_command import job_parser
from ghostvis_core.runs.launch_spec import LaunchSpec
from ghostvis_core.runs.lookup import identity_of, run_result
from ghostvis_core.store import Store, lease, open_store
from ghostvis_core.store.lease import Lease

MODEL_FILE = "registered_model.json"  # a run_file of the run
REGISTER_ENTRY = "ghostvis_core.run.hf.register"  # the registration job's module
MANIFEST_TAG = "ghostvis.manifest_sha256"


def stage_model(spec: LaunchSpec, store: Store) -> StageModel:
    """The run's model as the registry sees it: the stage's alias, the lineage and the sha256 of the training
    manifest its export carries as version tags."""
    result = run_result(store, spec.stage, spec.run_key)
    manifest = build_manifest(store, Ledger.in_store(store), spec.stage, spec.run_key)
    tags = {
        **spec.tags,
        "ghostvis.checkpoint_uri": result.checkpoint_uri,
        MANIFEST_TAG: manifest_sha256(manifest),  # the sha256 of the exported ghostvis_manifest.json
    }
    upstream = spec.tags.get("ghostvis.upstream_stage")
    if spec.parent_run_key and upstream in stage_names():  # a stage's run, not an HF import
        tags["ghostvis.parent_mlflow_run_id"] = run_result(store, upstream, spec.parent_run_key).mlflow_run_id
    return StageModel(
        spec.mlflow_experiment, spec.stage, result.mlflow_run_id, result.mlflow_experiment_id, result.steps, tags
    )


def export(spec: LaunchSpec, store: Store, out: Path) -> Path:
    """The run's Hugging Face folder, for MLflow to log (torch and the checkpoint are loaded only for a model
    not registered yet: a cache hit's subprocess only points the alias)."""
    from ghostvis_core.run.hf.export import export_run

    return export_run(store, spec.stage, spec.run_key, out)


def register_run(spec: LaunchSpec, store: Store, tracking_uri: str, held: Lease | None) -> dict:
    """Register the run's model (once per MLflow run), marked with its checks' verdict so far (the stage's
    alias on it only when they passed: a cache hit's registration job points it back); the outcome,
    also saved as the run's model_record. An MLflow failure is recorded, not raised: the run is complete.
    `held`: the lease on the run identity this process holds or joined; the registration is granted through
    its fence first (store/fence.py), so a launch that lost the lease registers nothing (`LeaseLost`)."""
    started, where = time.time(), {"pid": os.getpid(), "host": socket.gethostname(), "tracking_uri": tracking_uri}
    if held is not None:
        record_text = store.read_text("run_record", spec.stage, spec.run_key)
        held.commit("model_version", spec.stage, spec.run_key, text=record_text)
    try:
        model = stage_model(spec, store)
        verdict = run_verdict(store, spec.stage, spec.run_key)
        version, created = register_stage_model(tracking_uri, model, lambda out: export(spec, store, out), verdict)
        record = {
            **where,
            "model_uri": f"models:/{model.registered_name}@{spec.stage}",
            "version": int(version.version),
            "created": created,
            "checks": verdict.state,
            "seconds": round(time.time() - started, 1),
        }
    except Exception as exc:  # the registry is an add-on to a completed run: never lose the run for it
        record = {**where, "error": f"{type(exc).__name__}: {exc}"}
    store.write_json("run_file", spec.stage, spec.run_key, MODEL_FILE, data=record)
    return record


def model_record(store: Store, stage: str, run_key: str) -> dict | None:
    """What the run's last registration left (None: never registered from this run)."""
    if not store.exists("run_file", stage, run_key, MODEL_FILE):
        return None
    return store.read_json("run_file", stage, run_key, MODEL_FILE)


def main(argv: list[str] | None = None) -> int:
    ap = job_parser(REGISTER_ENTRY, __doc__, "the run's launch spec: its URI in the store")
    ap.add_argument("--tracking-uri", required=True, help="the MLflow server (or sqlite:///...) to register in")
    args = ap.parse_args(argv)
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # as in the job: an outage fails fast
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    store_uri, stage, run_key, _ = split_run_uri(args.spec)
    store = open_store(store_uri)
    held = lease.join(store, stage, identity_of(run_key))  # the stage asset's, while it registers a cache hit
    record = register_run(LaunchSpec.read(store, stage, run_key), store, args.tracking_uri, held)
    told = record.get("error") or f"{record['model_uri']} -> version {record['version']}"
    print(told, flush=True)
    pipes = PipesReporter(is_main=True)  # launched by the stage asset: the line reaches its log
    pipes.log(f"registration job: {told}")
    pipes.close()
    return 0


if __name__ == "__main__":
    skip_final_collections()
    sys.exit(main())

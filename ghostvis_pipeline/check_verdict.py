"""After each blocking check of a stage run: its outcome kept beside the run, and the run's verdict shown in
MLflow once it is known (ghostvis_core/run/track/check_verdict.py): the version tagged passed and given the
stage's alias, or tagged failed, its alias taken off and its MLflow run FAILED.

This runs in the checks because they are what decides: the training job registered the version before
Dagster checked the run. A registry that cannot be told now keeps the version as it was (pending: no
alias); the verdict is kept in the store, and a registration of the run (a cache hit's) marks it."""

from __future__ import annotations

from ghostvis_core.errors import GhostvisError
from ghostvis_core.home import Home
from ghostvis_core.run.track.check_verdict import (
    CHECKS_TAG,
    FAILED,
    PASSED,
    Verdict,
    mark_in_registry,
    record_check,
)
from ghostvis_core.run.track.mlflow_models import registered_version
from ghostvis_core.runs.launch_spec import LaunchSpec
from ghostvis_core.verify.audit.check_outcome import CheckOutcome
from ghostvis_core.verify.audit.stage_checks import stage_check_names


def settle_check(context, h: Home, stage: str, md: dict, check: str, outcome: CheckOutcome) -> Verdict:
    """Record `check`'s outcome for the materialization's run (`md`: its metadata) and, when that changes
    the run's verdict (its last check passed, its first one failed, a failed one passed a re-check), mark
    its model version in MLflow."""
    run_key = md["run_key"]
    before, verdict = record_check(
        h.store, stage, run_key, check, outcome.passed, outcome.failures[:100], stage_check_names(), context.run.run_id
    )
    if verdict.state == before.state:
        return verdict
    uri = h.mlflow_tracking_uri
    try:
        told = tell_registry(uri, LaunchSpec.read(h.store, stage, run_key).mlflow_experiment, stage, md, verdict)
    except Exception as exc:  # the verdict is kept in the store; a registration of the run marks it
        why = str(exc) if isinstance(exc, GhostvisError) else f"{type(exc).__name__}: {exc}"
        context.log.warning(f"{stage}: run {run_key}'s checks {verdict.state}, but MLflow ({uri}) was not told: {why}")
        return verdict
    context.log.info(f"{stage}: run {run_key}'s checks {verdict.state}: {told}")
    return verdict


def tell_registry(uri: str, registered_name: str, stage: str, md: dict, verdict: Verdict) -> str:
    """Mark the version registered from the run's MLflow run (`md`: the materialization's metadata) with the
    verdict; what was done."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    found = registered_version(client, registered_name, md["mlflow_run_id"])
    if found is None:
        raise GhostvisError(
            f"no version of {registered_name} is registered from MLflow run {md['mlflow_run_id']} (the run's "
            f"registered_model.json says why); the run's registration marks it {verdict.state} when it is made"
        )
    version = int(found.version)
    mark_in_registry(client, registered_name, stage, version, md["mlflow_run_id"], verdict)
    said = f"version {version} of {registered_name} tagged {CHECKS_TAG}={verdict.state}"
    if verdict.state == PASSED:
        return f"{said}, models:/{registered_name}@{stage} -> version {version}"
    if verdict.state == FAILED:
        return f"{said} ({', '.join(verdict.failed)} failed), no alias, its MLflow run FAILED"
    return f"{said} (waiting for {', '.join(verdict.missing)})"

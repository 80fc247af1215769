"""A stage run's final model in the MLflow Model Registry: logged with the transformers flavor (from
the Hugging Face export) into the stage's own MLflow run, registered as a version of the project's
registered model, the lineage in the version's tags; the stage's alias moves to it once its blocking
checks passed (check_verdict.py: until then the version is tagged `ghostvis.checks=pending`).

One registered model per project (named like the MLflow experiment, `ghostvis`) and one alias per
stage: the stages are successive checkpoints of one model, each starting from the one before, and
an alias is MLflow's name for the role a version plays (`models:/ghostvis@sft` is the sft run
Dagster materialized last whose checks passed, whatever its version number; the version's tags say which run
that is).

Registering is idempotent per MLflow run: a run that already has a version (a cache hit returns the
same run) gets no new one, only its checks' verdict shown again (the alias pointed back at it when they
passed); a run left unregistered (MLflow was down) is registered by the next materialization.

Two things in MLflow 3.17 decide how the model is passed: its transformers flavor cannot log a local
checkpoint folder with transformers 5 (`build_flavor_config_from_local_checkpoint` takes
`check_task(task)[1]["impl"].__name__`, a dotted string in transformers 5), and its default pip
requirements import torchvision. So the model and tokenizer are loaded from the export (no network:
a local folder) and the requirements are pinned here.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import version as installed
from pathlib import Path

from packaging.version import Version

from ghostvis_core.run.track.check_verdict import Verdict, mark_in_registry

# What loading the logged model needs (besides mlflow, which MLflow adds itself).
REQUIREMENTS = ("transformers", "torch", "safetensors")
SKIP_PIP_CHECK = "MLFLOW_SKIP_PIP_REQUIREMENTS_CHECK"  # mlflow.environment_variables


@dataclass(frozen=True)
class StageModel:
    """What the registry is told about one stage run's model."""

    registered_name: str
    stage: str  # the alias
    run_id: str  # the stage's MLflow run: the version's source run
    experiment_id: str
    step: int  # the run's last step: its metrics there are copied to the logged model
    tags: dict[str, str]  # the lineage, on the logged model and the version


def pinned_requirements() -> list[str]:
    """`package==version` as installed, without a local label (torch 2.13.0+cpu -> 2.13.0)."""
    return [f"{p}=={Version(installed(p)).public}" for p in REQUIREMENTS]


def registered_version(client, registered_name: str, run_id: str):
    """The version of the registered model registered from the MLflow run, or None."""
    found = client.search_model_versions(f"name = '{registered_name}' and run_id = '{run_id}'")
    return min(found, key=lambda v: int(v.version)) if found else None


def alias_on_run(tracking_uri: str, registered_name: str, alias: str, run_id: str) -> int | None:
    """The version the stage's alias points at when it was registered from the MLflow run `run_id` (None: no
    such alias, another run's version, or the registry cannot say). A read, for deciding whether a cache hit
    needs its registration job at all: the MLflow client only, no model is loaded. The registry is asked, not
    the run's model record: a home copied or moved elsewhere takes its MLflow database along."""
    from mlflow.tracking import MlflowClient

    try:
        found = MlflowClient(tracking_uri).get_model_version_by_alias(registered_name, alias)
    except Exception:  # no alias yet, or MLflow unreachable: the registration job finds out and says so
        return None
    return int(found.version) if found.run_id == run_id else None


def register_stage_model(tracking_uri: str, model: StageModel, export: Callable[[Path], Path], verdict: Verdict):
    """The run's registered version, marked with its checks' verdict (the stage's alias on it only when they
    passed): (version, True) when it was logged and registered now from `export(folder)` (a Hugging Face
    folder), (version, False) when the run already had one."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    found = registered_version(client, model.registered_name, model.run_id)
    created = found is None
    if created:
        with tempfile.TemporaryDirectory() as tmp:
            number = log_and_register(tracking_uri, model, export(Path(tmp) / "hf"))
        found = client.get_model_version(model.registered_name, number)
    mark_in_registry(client, model.registered_name, model.stage, int(found.version), model.run_id, verdict)
    return found, created


@contextmanager
def fluent_scope(tracking_uri: str, experiment_id: str) -> Iterator[None]:
    """MLflow's fluent API (which `log_model` uses) keeps the tracking URI and active experiment in
    process globals it also writes to `MLFLOW_TRACKING_URI` / `MLFLOW_EXPERIMENT_ID`; set them for one
    call and put the caller's environment back, so a process that goes on (a test's, a training job's) does
    not keep talking to this server afterwards. For that call MLflow also skips its requirements check (a
    `pip install --dry-run` of the requirements): they are pinned to what is installed here
    (`pinned_requirements`), so pip could only agree."""
    import mlflow

    saved = {name: os.environ.get(name) for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_ID", SKIP_PIP_CHECK)}
    os.environ[SKIP_PIP_CHECK] = "true"
    mlflow.set_tracking_uri(tracking_uri)
    mlflow.set_experiment(experiment_id=experiment_id)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(saved["MLFLOW_TRACKING_URI"])  # None: back to the environment's
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def log_and_register(tracking_uri: str, model: StageModel, hf_dir: Path) -> str:
    """Log the exported model into the stage's run and register it; its version number."""
    import mlflow.transformers
    from huggingface_hub import ModelCard
    from transformers import AutoModelForCausalLM, AutoTokenizer

    components = {
        "model": AutoModelForCausalLM.from_pretrained(hf_dir),
        "tokenizer": AutoTokenizer.from_pretrained(hf_dir),
    }
    card = ModelCard(
        f"# {model.registered_name}@{model.stage}\n\nGhostVis stage `{model.stage}`, run "
        f"`{model.tags.get('ghostvis.run_key', '')}`; the lineage is in the model version's tags.\n"
    )
    with fluent_scope(tracking_uri, model.experiment_id):
        info = mlflow.transformers.log_model(
            components,
            task="text-generation",
            name=model.stage,
            registered_model_name=model.registered_name,
            run_id=model.run_id,
            step=model.step,
            tags=model.tags,
            pip_requirements=pinned_requirements(),
            model_card=card,
        )
    return str(info.registered_model_version)

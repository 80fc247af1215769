"""Load a stage's trained model (and its tokenizer) from the artifact store, for evaluation and chat."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ghostvis_core.data.bpe_tokenizer import Tokenizer, load_tokenizer
from ghostvis_core.errors import GhostvisError
from ghostvis_core.home import Home
from ghostvis_core.plan.config import StageConfig
from ghostvis_core.runs.launch_spec import LaunchSpec
from ghostvis_core.runs.lookup import completed_runs, newest_completed_run
from ghostvis_core.runs.run_result import RunResult
from ghostvis_core.store import Store

if TYPE_CHECKING:  # torch is imported when a model is loaded: reading a run's config needs none
    from ghostvis_core.run.model.gpt import GPT


@dataclass
class TrainedStage:
    stage: str
    run_key: str
    checkpoint: Path
    config: StageConfig
    model: GPT
    tok: Tokenizer
    spec: LaunchSpec
    result: RunResult


def checkpoint_dir(store: Store, result: RunResult) -> Path:
    """The run's final checkpoint folder, found in the store by (stage, run_key) and its step folder's
    name, so a moved or copied home still finds it."""
    return store.fetch("checkpoint", result.stage, result.run_key, Path(result.checkpoint_uri).name)


def stage_config(store: Store, result: RunResult) -> StageConfig:
    """The resolved config the trainer saved with the run's final checkpoint."""
    path = checkpoint_dir(store, result) / "config.json"
    if not path.is_file():
        raise GhostvisError(
            f"stage {result.stage} run {result.run_key}: checkpoint config {path} is missing; "
            f"re-materialize the `{result.stage}` asset"
        )
    return StageConfig.from_dict(json.loads(path.read_text()))


def load_stage(home: Home, stage: str, run_key: str | None = None) -> TrainedStage:
    """The newest completed run of `stage` (or the named run) in the home's store, ready for inference on the CPU."""
    return load_from_store(home.store, stage, run_key)


def load_from_store(store: Store, stage: str, run_key: str | None = None) -> TrainedStage:
    """load_stage for a process that knows the store and not the home (a training job: its spec's store)."""
    from ghostvis_core.run.model.gpt import GPT
    from ghostvis_core.run.train import checkpoint as ckpt

    if run_key:
        result = next((r for r in completed_runs(store, stage) if r.run_key == run_key), None)
    else:
        result = newest_completed_run(store, stage)
    if result is None:
        raise GhostvisError(
            f"stage {stage} has no completed run{' ' + run_key if run_key else ''}; "
            f"materialize the `{stage}` asset first (or run `ghostvis demo`)"
        )
    path = checkpoint_dir(store, result)
    cfg = stage_config(store, result)
    spec = LaunchSpec.read(store, stage, result.run_key)
    model = GPT(cfg.model)
    if cfg.vision is not None:
        model.attach_vision(cfg.vision)
    ckpt.load_model(path, model)
    model.eval()
    tok = load_tokenizer(spec.tokenizer_id, store)
    return TrainedStage(stage, result.run_key, path, cfg, model, tok, spec, result)

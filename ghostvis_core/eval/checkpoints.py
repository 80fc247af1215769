"""Load a stage's trained model (and its tokenizer) from the artifact store, for evaluation and chat."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ghostvis_core.config import StageConfig
from ghostvis_core.data.tokenizer import Tokenizer, load_tokenizer
from ghostvis_core.errors import GhostvisError
from ghostvis_core.home import Home
from ghostvis_core.model.gpt import GPT
from ghostvis_core.train import checkpoint as ckpt
from ghostvis_core.train.launch import completed_runs
from ghostvis_core.train.spec import LaunchSpec


@dataclass
class TrainedStage:
    stage: str
    run_key: str
    checkpoint: Path
    config: StageConfig
    model: GPT
    tok: Tokenizer
    spec: LaunchSpec
    result: dict


def load_stage(home: Home, stage: str, run_key: str | None = None) -> TrainedStage:
    """The newest completed run of `stage` (or the named run), ready for inference on the CPU."""
    runs = completed_runs(home, stage)
    if run_key:
        runs = [r for r in runs if r["run_key"] == run_key]
    if not runs:
        raise GhostvisError(f"stage {stage} has no completed run{' ' + run_key if run_key else ''}; "
                            f"materialize the `{stage}` asset first (or run `ghostvis demo`)")
    result = runs[-1]
    path = Path(result["checkpoint_uri"])
    cfg = StageConfig.from_dict(json.loads((path / "config.json").read_text()))
    spec = LaunchSpec.load(home.run_dir(stage, result["run_key"]) / "spec.json")
    model = GPT(cfg.model)
    if cfg.vision is not None:
        model.attach_vision(cfg.vision)
    ckpt.load_model(path, model)
    model.eval()
    return TrainedStage(stage, result["run_key"], path, cfg, model, load_tokenizer(spec.tokenizer_dir), spec, result)

"""LaunchSpec: everything one stage run needs, resolved before torchrun starts.

The spec is a JSON file; the training process reads it and nothing else (it does not query the
ledger or know it was started by Dagster). It is written next to the run's logs.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class LaunchSpec:
    stage: str
    run_key: str
    config: dict[str, Any]  # the resolved StageConfig
    plan: dict[str, Any]  # budget.Plan
    home: str
    tokenizer_id: str
    tokenizer_dir: str
    train_shards: dict[str, list[dict[str, Any]]]  # source -> ShardRef dicts
    val_shards: dict[str, list[dict[str, Any]]]
    checkpoint_dir: str
    ledger_dir: str
    mlflow_tracking_uri: str
    mlflow_experiment: str
    mlflow_artifact_location: str
    parent_run_key: str | None = None
    init_checkpoint: str | None = None
    tags: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # stage-specific inputs (eval sets, etc.)

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(asdict(self), indent=2, sort_keys=True))
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: Path) -> "LaunchSpec":
        return cls(**json.loads(Path(path).read_text()))

"""TrainState: where a run is, saved with every checkpoint as one file (train_state.json).

Step, loader position (global rows consumed), token counts along the run's chain, the head of the
ledger-part chain, the MLflow run, the evaluation history and the RNG states: everything a resume
needs besides the weights and the optimizer.
"""

from __future__ import annotations

import base64
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ghostvis_core.counts import TokenCounts

STATE_FILE = "train_state.json"


@dataclass
class TrainState:
    run_key: str
    tokens_per_step: int
    world_size: int
    step: int = 0
    rows: int = 0  # the loader position: global rows consumed (independent of world size)
    segment: int = 0  # launches of this run: 0 for the first, +1 per resume
    head_part_id: str | None = None  # the newest ledger part of this run's chain
    counts: TokenCounts = field(default_factory=TokenCounts)
    mlflow_run_id: str | None = None
    history: dict[str, dict[str, float]] = field(default_factory=dict)  # val_start, val_last
    generated: dict[str, int] = field(default_factory=dict)  # rl: running ROLLOUT_FIGURES along the chain
    rng: dict[str, str] = field(default_factory=dict)  # device -> base64 of torch's RNG state

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainState":
        return cls(**{**data, "counts": TokenCounts(**data["counts"])})

    def capture_rng(self) -> None:
        self.rng = {"cpu": _b64(torch.get_rng_state())}
        if torch.cuda.is_available():
            self.rng["cuda"] = _b64(torch.cuda.get_rng_state())

    def restore_rng(self) -> None:
        if "cpu" in self.rng:
            torch.set_rng_state(_tensor(self.rng["cpu"]))
        if "cuda" in self.rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(_tensor(self.rng["cuda"]))


def _b64(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode()


def _tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()

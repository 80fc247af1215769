"""TrainState: where a run is, saved with every checkpoint as one file (train_state.json).

Step, loader position (global rows consumed), token counts along the run's chain, the head of the
ledger-part chain, the MLflow run, the evaluations at step 0 and at the newest checkpoint and the RNG
states: everything a resume needs besides the weights and the optimizer. The file keeps the loader's
`rows` and a `history` object of the two evaluations at its top level.
"""

from __future__ import annotations

import base64
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ghostvis_core.counts import TokenCounts
from ghostvis_core.data.loader import LoaderPosition

STATE_FILE = "train_state.json"


@dataclass
class TrainState:
    run_key: str
    tokens_per_step: int
    world_size: int
    step: int = 0
    loader: LoaderPosition = field(default_factory=LoaderPosition)
    segment: int = 0  # launches of this run: 0 for the first, +1 per resume
    head_part_id: str | None = None  # the newest ledger part of this run's chain
    counts: TokenCounts = field(default_factory=TokenCounts)
    mlflow_run_id: str | None = None
    val_start: dict[str, float] = field(default_factory=dict)  # the evaluation at step 0
    val_last: dict[str, float] = field(default_factory=dict)  # the evaluation last logged before the newest checkpoint
    generated: dict[str, int] = field(default_factory=dict)  # rl: running ROLLOUT_FIGURES along the chain
    rng: dict[str, str] = field(default_factory=dict)  # device -> base64 of torch's RNG state

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        history = {"val_start": data.pop("val_start"), "val_last": data.pop("val_last")}
        del data["loader"]
        return {**data, **self.loader.state_dict(), "history": history}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainState:
        fields = {k: v for k, v in data.items() if k not in ("rows", "history", "counts")}
        history = data["history"]
        state = cls(
            **fields,
            counts=TokenCounts(**data["counts"]),
            val_start=history.get("val_start", {}),
            val_last=history.get("val_last", {}),
        )
        state.loader.load_state_dict(data)
        return state

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

"""RunResult: what a finished stage run reports, typed.

The trainer writes it as the run's record (artifact kind run_record, RUN_COMPLETE.json); the
pipeline maps its fields to Dagster metadata, the report and evaluation read it. Nobody parses key
names: a figure is a field.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ghostvis_core.counts import TokenCounts
from ghostvis_core.plan.batch import BatchPlan


@dataclass
class BeforeAfter:
    """An evidence figure measured on held-out data at step 0 and after training."""

    before: float | None
    after: float


@dataclass
class MixtureShare:
    """Per source: the fraction of the run's consumed tokens (from the ledger) vs its recipe weight."""

    fraction: float
    weight: float
    tokens: int


@dataclass
class FrozenCheck:
    """Hashes of the parameters a stage keeps frozen, before and after training."""

    sha256_before: str
    sha256_after: str

    @property
    def unchanged(self) -> bool:
        return self.sha256_before == self.sha256_after


@dataclass
class RunResult:
    run_key: str
    stage: str
    steps: int
    segment: int
    counts: TokenCounts
    planned_tokens: int
    batch: BatchPlan  # the four factors of tokens_per_step, as trained
    train_loss: float
    val_loss: float | None
    val_loss_start: float | None
    tokens_per_sec: float
    first_step_s: float
    wall_time_s: float
    checkpoint_uri: str
    parent_run_key: str | None
    mlflow_run_id: str
    mlflow_experiment_id: str
    evidence: dict[str, BeforeAfter] = field(default_factory=dict)
    mixture: dict[str, MixtureShare] = field(default_factory=dict)
    frozen: FrozenCheck | None = None
    mlflow_delivery: dict[str, float] = field(default_factory=dict)  # failed flushes, gap, unsent metrics
    # Measured efficiency (train/efficiency.py): MFU at tokens_per_sec against peak_flops per device.
    mfu: float | None = None
    flops_per_token: float | None = None
    peak_flops: float | None = None
    peak_source: str = ""
    cuda_peak_memory_gb: float | None = None  # max allocated on rank 0's GPU; None without CUDA
    attention_kernel: str = ""  # what attended packed documents (run/model/gpt.py attention_kernel)
    generated: dict[str, int] = field(default_factory=dict)  # rl: counts.ROLLOUT_FIGURES over the run

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "batch": self.batch.to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunResult:
        return cls(
            **{
                **data,
                "counts": TokenCounts(**data["counts"]),
                "batch": BatchPlan.of(data["batch"]),
                "evidence": {k: BeforeAfter(**v) for k, v in data["evidence"].items()},
                "mixture": {k: MixtureShare(**v) for k, v in data["mixture"].items()},
                "frozen": FrozenCheck(**data["frozen"]) if data.get("frozen") else None,
            }
        )

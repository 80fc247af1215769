"""The batch-factor tuple, one type for it everywhere: the planner resolves it (budget.batch_plan), the
trainer steps by it, the run record keeps it, and the audit reads it back from a launch spec's plan
or a ledger part. tokens_per_step = micro_batch_size x seq_len x world_size x grad_accum_steps.

It imports nothing of the project, so the audit can read it without reaching the trainer's code.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

# The label of a position no loss is computed on (padding, prompts, images): the loader writes it, the losses skip it.
IGNORE_INDEX = -1


@dataclass(frozen=True)
class BatchPlan:
    micro_batch_size: int
    seq_len: int
    world_size: int
    grad_accum_steps: int

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch_size * self.seq_len * self.world_size * self.grad_accum_steps

    @property
    def rows_per_step(self) -> int:
        """Packed rows (of seq_len tokens) one optimizer step reads, over all ranks."""
        return self.micro_batch_size * self.world_size * self.grad_accum_steps

    @classmethod
    def of(cls, record: Mapping[str, Any]) -> BatchPlan:
        """The four factors of a record that holds them by name (a launch spec's plan, a run record's
        batch, a ledger part); the figures derived from them there are derived again, not read."""
        return cls(
            int(record["micro_batch_size"]),
            int(record["seq_len"]),
            int(record["world_size"]),
            int(record["grad_accum_steps"]),
        )

    def to_dict(self) -> dict[str, int]:
        """The four factors and tokens_per_step, as a run record keeps them (readable without the code)."""
        return {**asdict(self), "tokens_per_step": self.tokens_per_step}

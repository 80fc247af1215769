"""TokenCounts: the four token figures every stage reports, as one type.

The loader counts them per batch, the loop sums them over micro-batches and ranks, the ledger stores
them per part, MLflow charts them and the Dagster checks compare them. Their names in each of those
places come from here, so a figure cannot be spelled two ways (see docs/glossary.md).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

# figure -> the MLflow metric that charts its running total
MLFLOW_METRICS = {
    "real_tokens": "tokens/real",
    "pad_tokens": "tokens/pad",
    "loss_tokens": "tokens/loss",
    "cropped_tokens": "tokens/cropped",
}

# The rl stage's rollout figures (ghostvis_core/run/train/grpo.py), per step and rank in the ledger's `rollouts`
# table, as running totals in MLflow, the run record and the Dagster metadata: tokens the policy generated,
# those of completions that earned a reward, completions sampled and those with the exact answer.
ROLLOUT_FIGURES = ("generated_tokens", "rewarded_tokens", "completions", "correct_completions")
ROLLOUT_METRICS = {
    "generated_tokens": "tokens/generated",
    "rewarded_tokens": "tokens/rewarded",
    "completions": "rl/completions",
    "correct_completions": "rl/correct_completions",
}
# Each rl step's sampled-reward figures (grpo.count_step) under TRL's GRPO names, charted in MLflow and tabled in
# the report card: the rewards' mean, the mean of the groups' reward standard deviations, the share of groups whose
# rewards are all equal (no advantage, no gradient), the share of exact answers and, only with a reference model
# (grpo.kl_beta > 0, as TRL logs `kl`), the mean k3 KL to it per generated token.
GRPO_STEP_METRICS = ("rl/reward_mean", "rl/reward_std", "rl/frac_reward_zero_std", "rl/exact_rate", "rl/kl")


@dataclass(frozen=True)
class TokenCounts:
    """real: document tokens; pad: padding; loss: tokens carrying loss; cropped: read but never trained."""

    real_tokens: int = 0
    pad_tokens: int = 0
    loss_tokens: int = 0
    cropped_tokens: int = 0

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_list(cls, values) -> TokenCounts:
        """From numbers in `names()` order (an all-reduced tensor's list)."""
        return cls(*(int(v) for v in values))

    @classmethod
    def from_mapping(cls, data) -> TokenCounts:
        """From any mapping holding the four names (a ledger row, a metadata dict)."""
        return cls(*(int(data[k]) for k in cls.names()))

    @classmethod
    def total(cls, items) -> TokenCounts:
        out = cls()
        for c in items:
            out = out + c
        return out

    def __add__(self, other: TokenCounts) -> TokenCounts:
        return TokenCounts(*(a + b for a, b in zip(self.as_list(), other.as_list())))

    def as_list(self) -> list[int]:
        return [getattr(self, k) for k in self.names()]

    def as_dict(self) -> dict[str, int]:
        return dict(zip(self.names(), self.as_list()))

    def as_metrics(self) -> dict[str, int]:
        """The MLflow metric names and values."""
        return {MLFLOW_METRICS[k]: v for k, v in self.as_dict().items()}

    @property
    def consumed(self) -> int:
        """Positions the trainer filled: real + pad (what steps x tokens_per_step must equal)."""
        return self.real_tokens + self.pad_tokens

"""Which way each evidence figure moves when its stage did its job: the report card's verdict on a stage's
before/after figures. Plain figures, no torch: the report is written in the Dagster process."""

from __future__ import annotations

# The way each evidence figure moves when its stage did its job (the report card's verdict). The figures not named
# are context for another (the within-context loss, the losses under the upstream RoPE, the shuffled-image loss).
LOWER_IS_BETTER = frozenset(
    {"domain_loss", "loss_beyond_context", "answer_loss", "caption_loss_true_image", "role_leak_rate"}
)
HIGHER_IS_BETTER = frozenset(
    {
        "answer_accuracy",
        "caption_image_gap",
        "eot_rate",
        "preference_accuracy",
        "reward_margin",
        "chosen_preferred",
        "reward",
        "exact_accuracy",
        "format_rate",
    }
)


def improved(name: str, before: float | None, after: float | None) -> bool | None:
    """Whether an evidence figure moved the way its stage should move it (after strictly better than before);
    None for a context figure or one without both values. A rate kept at its best (1 up, 0 down) counts: it
    cannot move further."""
    if before is None or after is None or name not in LOWER_IS_BETTER | HIGHER_IS_BETTER:
        return None
    if name in LOWER_IS_BETTER:
        return after < before or before == after == 0.0
    return after > before or before == after == 1.0

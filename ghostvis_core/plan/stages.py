"""The stage table: the one declaration of the training chain.

Presets, the Dagster asset chain and its descriptions, the CLI's stage list and the README's stage
table are all derived from `STAGES`. Adding a stage is one entry here plus its objective
(ghostvis_core/run/train/objectives.py) and its preset values (ghostvis_core/plan/presets.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from ghostvis_core.errors import GhostvisError
from ghostvis_core.plan.config import Objective

# The lineage quality gate's default (ghostvis_core/verify/eval/quality_gate.py): a stage may score at most 10% more
# bits per byte than the stage it starts from on any held-out text source.
BPB_TOLERANCE = 0.10


@dataclass(frozen=True)
class Stage:
    name: str
    upstream: str | None  # the stage whose final checkpoint initialises this one (None: random init)
    objective: Objective  # a key of ghostvis_core.run.train.objectives.OBJECTIVES
    reads: str  # the source kind it trains on; an empty data.recipe means every registered source of it
    description: str
    evidence: tuple[str, ...] = ()  # default eval.evidence: measured before and after training
    bpb_tolerance: float = BPB_TOLERANCE  # allowed held-out bpb worsening vs upstream (the quality gate)


STAGES: tuple[Stage, ...] = (
    Stage("pretrain", None, "lm", "text", "Pretrains the decoder LM from scratch on the token ledger's train shards."),
    Stage(
        "continued_pretrain",
        "pretrain",
        "lm",
        "text",
        "Continues pretraining on a declared domain mixture (code-heavy), where pretraining stopped "
        "reading each source. Evidence: mixture fractions vs recipe, held-out domain loss.",
        ("domain_loss",),
    ),
    Stage(
        "context_expansion",
        "continued_pretrain",
        "lm",
        "text",
        "Raises the context (256 -> 1024 in the demo) with a 16x larger RoPE base (ABF) on long documents. "
        "Evidence: held-out loss beyond the old context, before vs after.",
        ("beyond_context_loss",),
    ),
    Stage(
        "reasoning_mix",
        "context_expansion",
        "lm",
        "text",
        "Trains on step-by-step arithmetic problems plus declared replay of earlier prose. "
        "Evidence: answer-token loss and answer accuracy, before vs after.",
        ("reasoning",),
    ),
    Stage(
        "vision_alignment",
        "reasoning_mix",
        "vision_align",
        "image_caption",
        "Trains a perceiver resampler + MLP projector between a frozen vision encoder and the frozen LM "
        "on image-caption pairs. Evidence: caption loss, true vs shuffled image.",
        ("caption_image_gap",),
    ),
    Stage(
        "sft",
        "vision_alignment",
        "sft",
        "chat",
        "Supervised fine-tuning on packed chats, loss on assistant tokens only. Evidence: assistant loss "
        "and how many sampled replies end with <|eot|>.",
        ("reply_endings",),
    ),
    Stage(
        "dpo",
        "sft",
        "dpo",
        "preference",
        "Preference optimisation on chosen/rejected pairs (dpo.loss: sigmoid DPO, ipo or sft_dpo against the "
        "frozen SFT model, or reference-free simpo). Evidence: preference accuracy and "
        "reward margin on held-out pairs (computed by the DPO objective).",
    ),
    Stage(
        "rl",
        "dpo",
        "grpo",
        "problem",
        "Group-relative policy optimisation (GRPO) on problems (prompt + answer): G sampled solutions per "
        "prompt, reward 1 for the answer the source's reward rule accepts (integer, string or regex) plus 0.1 "
        "for a last line that is only one; every generated token is accounted. Evidence: reward, exact-answer "
        "accuracy and well-formed answer rate on held-out problems, before vs after.",
        ("reward",),
    ),
)


def stage_names() -> list[str]:
    """Stage names in dependency order."""
    return [s.name for s in STAGES]


# Objectives whose model is trained on the chat template (ghostvis_core/data/chat.py): `ghostvis chat` opens them.
CHAT_OBJECTIVES = ("sft", "dpo", "grpo")


def chat_stage_names() -> list[str]:
    return [s.name for s in STAGES if s.objective in CHAT_OBJECTIVES]


def stage(name: str) -> Stage:
    for s in STAGES:
        if s.name == name:
            return s
    raise GhostvisError(f"unknown stage '{name}'; stages are: {', '.join(stage_names())}")


def markdown_table() -> str:
    """The README's stage table (tests/test_stages.py keeps the README equal to it)."""
    lines = ["| stage | starts from | objective | reads | what it trains | evidence |", "|---|---|---|---|---|---|"]
    for s in STAGES:
        what = s.description.split(" Evidence:")[0]
        lines.append(
            f"| {s.name} | {s.upstream or 'random init'} | {s.objective} | {s.reads} | {what} | "
            f"{', '.join(s.evidence) or '-'} |"
        )
    return "\n".join(lines)

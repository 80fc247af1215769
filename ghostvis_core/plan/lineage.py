"""The lineage: which stages of the table a model goes through, and what each one starts from.

The stage table (stages.py) is the full chain of a vision-language model. A text-only LLM skips
vision_alignment; a user fine-tuning a model they already have starts at sft from an imported checkpoint.
`GHOSTVIS_LINEAGE` (else the preset's: selected.py) selects the lineage in one place, read by the Dagster
code location (the asset graph holds only its stages, each depending on the stage it starts from), by the
CLI and by `presets.resolve` (a stage's default `init_from` is its lineage upstream):

- a name: `vlm` (every stage, the default), `llm` (every stage but vision_alignment), `chat` (sft, dpo,
  rl: sft starts from the model given as its `init_from`), `demo` (vlm with rl on reasoning_mix: the tiny
  preset's: selected.PRESET_LINEAGES);
- or stages in chain order, comma-separated: `pretrain,sft,dpo,rl`. A stage starts from the nearest
  listed stage below it in the table's chain (sft from pretrain above); `rl<sft` names another listed
  stage to start from. A listed stage with no listed stage below it starts from random init if the table
  says so (pretrain), else from the `init_from` its run config gives (a Hugging Face model).
"""

from __future__ import annotations

from dataclasses import dataclass

from ghostvis_core.errors import GhostvisError
from ghostvis_core.plan import stages

ENV = "GHOSTVIS_LINEAGE"
NAMED: dict[str, str] = {
    "vlm": ",".join(stages.stage_names()),
    "llm": ",".join(s for s in stages.stage_names() if stages.stage(s).objective != "vision_align"),
    "chat": "sft,dpo,rl",
    # The tiny demo's: rl on reasoning_mix, the policy that writes the `Answer: <integer>` line its reward reads
    # (from the demo's dpo model no completion is ever rewarded: presets.py, the tiny preset's rl).
    "demo": ",".join(stages.stage_names()[:-1]) + ",rl<reasoning_mix",
}


@dataclass(frozen=True)
class Lineage:
    name: str  # the named lineage, or the spec itself
    starts: tuple[tuple[str, str | None], ...]  # (stage, the listed stage it starts from), chain order

    def stage_names(self) -> list[str]:
        return [s for s, _ in self.starts]

    def upstream(self, stage: str) -> str | None:
        """The stage this one starts from in the lineage (None: random init or an imported model)."""
        return dict(self.starts)[self.require(stage)]

    def below(self, stage: str) -> list[str]:
        """Every stage `stage` is trained on top of: its upstream, the upstream's upstream, ..."""
        below: list[str] = []
        up = self.upstream(stage)
        while up:
            below.append(up)
            up = self.upstream(up)
        return below

    def needs_model(self, stage: str) -> bool:
        """True for a stage that starts the lineage where the table has a stage below it: it trains on top of
        a model its run config names (`init_from`), never from random init."""
        return self.upstream(stage) is None and stages.stage(stage).upstream is not None

    def chat_stages(self) -> list[str]:
        """The stages whose model follows the chat template: a chat objective, trained on top of an sft (or of
        a model its run config names, which the user brings as a chat model)."""
        return [
            s
            for s in self.stage_names()
            if s in stages.chat_stage_names()
            and (stages.stage(s).objective == "sft" or self.needs_model(s) or "sft" in self.below(s))
        ]

    def require(self, stage: str) -> str:
        stages.stage(stage)  # an unknown name: the table's message
        if stage not in dict(self.starts):
            raise GhostvisError(
                f"stage {stage} is not in the lineage {self.name} ({', '.join(self.stage_names())}); "
                f"add it to {ENV} (e.g. {ENV}=vlm) or pick one of its stages"
            )
        return stage

    def describe(self) -> str:
        """One line per stage for the CLI, the Dagster asset descriptions and the report card."""
        return "; ".join(f"{s} <- {self.start_text(s)}" for s, _ in self.starts)

    def start_text(self, stage: str) -> str:
        """What the stage starts from, in words."""
        return self.upstream(stage) or ("the init_from model" if self.needs_model(stage) else "random init")


def parse(spec: str) -> Lineage:
    """A lineage from a name or a comma-separated list of stages, refused with the fix when it cannot train."""
    text = NAMED.get(spec.strip(), spec)
    order = stages.stage_names()
    starts: list[tuple[str, str | None]] = []
    for item in (i.strip() for i in text.split(",") if i.strip()):
        name, _, start = (p.strip() for p in item.partition("<"))
        if name not in order:
            raise GhostvisError(
                f"{ENV}={spec}: unknown stage {name!r}; stages are {', '.join(order)}, or a lineage name "
                f"({', '.join(NAMED)})"
            )
        listed = [s for s, _ in starts]
        if name in listed or (listed and order.index(name) < order.index(listed[-1])):
            raise GhostvisError(
                f"{ENV}={spec}: {name} is listed twice or out of chain order; list stages once each, in the order "
                f"{', '.join(order)}"
            )
        if start and start not in listed:
            raise GhostvisError(
                f"{ENV}={spec}: {name} starts from {start!r}, which is not listed before it; a stage starts from an "
                f"earlier listed stage (or from a model: set its init_from)"
            )
        starts.append((name, start or _nearest_below(name, listed)))
    if not starts:
        raise GhostvisError(f"{ENV}={spec!r} lists no stage; give a lineage name ({', '.join(NAMED)}) or stages")
    return Lineage(spec.strip(), tuple(starts))


def _nearest_below(name: str, listed: list[str]) -> str | None:
    """The nearest stage below `name` in the table's chain that the lineage lists."""
    up = stages.stage(name).upstream
    while up and up not in listed:
        up = stages.stage(up).upstream
    return up

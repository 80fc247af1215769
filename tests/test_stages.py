"""The stage table is the one declaration of the chain: presets, the Dagster assets, the CLI and the
README are derived from it, and a preset only states what differs from the config defaults."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest

from ghostvis_core.errors import GhostvisError
from ghostvis_core.plan import config, presets, selected
from ghostvis_core.plan.stages import STAGES, markdown_table, stage, stage_names
from tests.ledger_rows import shard_record

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_readme_stage_table_is_the_generated_one():
    text = README.read_text()
    block = re.search(r"<!-- stages:begin -->\n(.*?)\n<!-- stages:end -->", text, re.S)
    assert block, "README.md lacks the <!-- stages:begin --> ... <!-- stages:end --> block"
    assert block.group(1).strip() == markdown_table()


def test_the_chain_is_ordered_and_every_upstream_is_a_stage():
    names = stage_names()
    assert names == [
        "pretrain",
        "continued_pretrain",
        "context_expansion",
        "reasoning_mix",
        "vision_alignment",
        "sft",
        "dpo",
        "rl",
    ]
    for i, s in enumerate(STAGES):
        assert s.upstream is None if i == 0 else names.index(s.upstream) < i


def test_resolved_configs_take_objective_upstream_and_evidence_from_the_table(monkeypatch):
    monkeypatch.setenv("GHOSTVIS_LINEAGE", "vlm")  # the table's own chain
    for s in STAGES:
        cfg = presets.resolve(s.name, "tiny")
        assert (cfg.objective, cfg.init_from, tuple(cfg.eval.evidence)) == (s.objective, s.upstream, s.evidence)
    assert presets.resolve("continued_pretrain", "tiny").eval.evidence == ("domain_loss",)


def test_an_unknown_stage_names_the_stages():
    with pytest.raises(GhostvisError, match="unknown stage 'sfft'; stages are: pretrain, continued_pretrain"):
        stage("sfft")


def test_the_dagster_chain_and_descriptions_come_from_the_table():
    from dagster import AssetKey

    from ghostvis_pipeline.definitions import defs

    graph = defs.resolve_asset_graph()
    chain = selected.lineage()  # as the code location was loaded here: the default preset's (tiny: "demo")
    for s in STAGES:
        node = graph.get(AssetKey(s.name))
        deps = {k.to_user_string() for k in node.parent_keys}
        below = STAGES[: [t.name for t in STAGES].index(s.name)]  # the table's chain is linear
        if s.name == "rl" and chain.name == "demo":  # rl on reasoning_mix: no vision, sft or dpo below it
            below = [t for t in below if t.name not in ("vision_alignment", "sft", "dpo")]
        assert deps == {"token_ledger", "tokenizer", *(t.name for t in below)}, s.name
        start = chain.upstream(s.name) or "random init"
        assert node.description == f"{s.description} Lineage {chain.name}: starts from {start}."


def _defaults(tp) -> dict[str, typing.Any]:
    """Dataclass field defaults, by dotted name."""
    out = {}
    for f in dataclasses.fields(tp):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


SECTIONS = {
    "batch": config.BatchConfig,
    "optim": config.OptimConfig,
    "budget": config.BudgetConfig,
    "data": config.DataConfig,
    "eval": config.EvalConfig,
    "checkpoint": config.CheckpointConfig,
    "runtime": config.RuntimeConfig,
    "vision": config.VisionConfig,
    "dpo": config.DPOConfig,
    "model": config.ModelConfig,
    "parallel": config.ParallelConfig,
    "grpo": config.GRPOConfig,
}


@pytest.mark.parametrize("preset", presets.preset_names())
def test_presets_state_only_values_that_differ_from_the_dataclass_defaults(preset):
    restated = []
    for name in stage_names():
        try:
            values = presets._stage_defaults(name, preset)
        except GhostvisError:
            continue  # a GPU preset without defaults for this stage
        for section, fields in values.items():
            defaults = _defaults(SECTIONS[section])
            restated += [f"{name}.{section}.{k}={v!r}" for k, v in fields.items() if k in defaults and defaults[k] == v]
    assert not restated, f"preset {preset} restates dataclass defaults: {restated}"


SHARDS = (
    shard_record("web/train", source="web", split="train", kind="text", tokens=300),
    shard_record("web/validation", source="web", split="validation", kind="text", tokens=50),
    shard_record("books/train", source="books", split="train", kind="text", tokens=100),
    shard_record("chats/train", source="chats", split="train", kind="chat", tokens=900),
)


def test_a_stage_follows_the_registered_sources_of_its_kind_when_its_preset_names_others():
    # the demo recipe (demo_prose, demo_code) names no registered source: the registered text ones, by tokens
    cfg = presets.resolve("pretrain", "tiny", sources=presets.RegisteredSources("tok", SHARDS))
    assert [(s.source, s.weight) for s in cfg.data.recipe] == [("books", 0.25), ("web", 0.75)]
    assert cfg.data.val_sources == ("web",)


def test_a_recipe_of_the_users_naming_unregistered_sources_names_the_registered_ones():
    with pytest.raises(
        GhostvisError,
        match=r"the recipe names source\(s\) webb, which are not registered "
        r"\(sources tokenized with tok: books, chats, web\); set the stage's recipe",
    ):
        presets.resolve(
            "pretrain",
            "tiny",
            presets.data_overrides({"webb": 1.0}, []),
            sources=presets.RegisteredSources("tok", SHARDS),
        )
    sft = presets.resolve("sft", "tiny", sources=presets.RegisteredSources("tok", SHARDS))
    assert [(s.source, s.weight) for s in sft.data.recipe] == [("chats", 1.0)] and sft.data.val_sources == ()

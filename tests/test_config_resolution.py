"""One resolution step makes every stage config: its precedence, its frozen typed result, its inputs from the
run's data (tokenizer vocabulary, registered sources), and the launch spec that carries it typed.

tests/data/resolved_configs.json holds, for every stage x preset and run mode, the flattened config (or the
refusal) that the code before `presets.resolve` took these inputs produced; a deliberate preset change updates it:
.venv/bin/python -c 'import json, tests.test_config_resolution as t;
  t.GOLDEN.write_text(json.dumps(t.resolved_values(), indent=1, sort_keys=True))'
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from ghostvis_core.data.shard_ref import ShardRef
from ghostvis_core.errors import GhostvisError
from ghostvis_core.plan import presets, run_modes, stages
from ghostvis_core.plan.budget import Plan, plan
from ghostvis_core.plan.config import StageConfig, flatten
from ghostvis_core.runs.launch_spec import LaunchSpec, StageInputs
from ghostvis_core.store import open_store
from tests.launch_records import launch_record
from tests.ledger_rows import shard_record

GOLDEN = Path(__file__).resolve().parent / "data" / "resolved_configs.json"
TEXT = (
    shard_record("web/train", source="web", split="train", kind="text", tokens=300),
    shard_record("web/validation", source="web", split="validation", kind="text", tokens=50),
)


def resolved_values() -> dict[str, dict]:
    """stage/preset -> the flattened resolved config, or {"error": the refusal}."""
    out = {}
    for name in [*presets.preset_names(), *run_modes.MODES]:
        for stage in stages.stage_names():
            try:
                out[f"{stage}/{name}"] = flatten(presets.resolve(stage, name).to_dict())
            except GhostvisError as exc:
                out[f"{stage}/{name}"] = {"error": str(exc)}
    return out


def test_every_stage_and_preset_resolves_to_the_values_it_had_before():
    want, got = json.loads(GOLDEN.read_text()), resolved_values()
    assert sorted(got) == sorted(want)
    differ = {
        key: sorted(k for k in {*want[key], *got[key]} if want[key].get(k) != got[key].get(k))
        for key in want
        if want[key] != got[key]
    }
    assert not differ, f"resolved values changed: {differ}"
    assert sum("error" not in v for v in got.values()) == 28  # 8 stages x (tiny, smoke) + pretrain x 3 + 9 modes


def test_each_input_wins_over_the_ones_before_it():
    upstream = presets.resolve("continued_pretrain", "tiny").to_dict()
    upstream["model"] |= {"d_model": 128, "ffn_hidden": 344, "rope_scaling": 2.0}  # a checkpoint of another shape
    cfg = presets.resolve(
        "context_expansion",
        "tiny",
        {"optim.lr": "1e-4"},
        upstream=upstream,
        sources=presets.RegisteredSources("tok", TEXT),
    )
    assert cfg.optim.beta1 == 0.9  # 1. the dataclass default
    assert (cfg.objective, cfg.init_from, cfg.eval.evidence) == ("lm", "continued_pretrain", ("beyond_context_loss",))
    assert cfg.checkpoint.every_steps == 9  # 3. the preset's delta over the default 100
    assert (cfg.model.d_model, cfg.model.rope_scaling) == (128, 2.0)  # 4. inherited from the upstream checkpoint
    assert (cfg.model.max_seq_len, cfg.model.rope_base) == (1024, 160000.0)  # the preset's declared model change
    assert cfg.optim.lr == 1e-4  # 5. the override over the preset's 5e-4
    assert [(s.source, s.weight) for s in cfg.data.recipe] == [("web", 1.0)]  # 6. the registered sources
    assert cfg.data.val_sources == ("web",)


def test_the_tokenizer_vocabulary_sizes_a_fresh_model_and_must_match_a_continued_one():
    vocab = presets.TokenizerVocab("tok", 4000)
    assert presets.resolve("pretrain", "smoke", vocab=vocab).model.vocab_size == 4032  # padded to 64
    with pytest.raises(
        GhostvisError,
        match=r"model.vocab_size=4096 does not fit tokenizer tok \(4000 tokens, "
        r"padded to 4032\); drop the override",
    ):
        presets.resolve("pretrain", "smoke", {"model.vocab_size": 4096}, vocab=vocab)
    upstream = presets.resolve("pretrain", "smoke").to_dict()  # vocab_size 4096
    with pytest.raises(
        GhostvisError,
        match=r"tokenizer tok has 4000 tokens \(padded 4032\) but the upstream "
        r"pretrain model has vocab_size 4096",
    ):
        presets.resolve("continued_pretrain", "smoke", upstream=upstream, vocab=vocab)


def test_the_resolved_config_is_frozen_to_the_leaves():
    cfg = presets.resolve("reasoning_mix", "tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.optim.lr = 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.data.recipe[0].weight = 1.0
    assert isinstance(cfg.data.recipe, tuple) and isinstance(cfg.data.replay_sources, tuple)
    faster = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=1e-3))
    assert (faster.optim.lr, cfg.optim.lr) == (1e-3, 7e-4)


@pytest.mark.parametrize(
    "key, value, choices",
    [
        ("parallel.strategy", "zero3", "ddp, fsdp"),
        ("optim.name", "sgd", "adamw, muon"),
        ("runtime.precision", "fp16", "auto, bf16, fp32"),
        ("runtime.compile", "yes", "auto, on, off"),
        ("objective", "ppo", "lm, vision_align, sft, dpo, grpo"),
    ],
)
def test_an_enum_like_field_names_the_field_the_value_and_the_choices(key, value, choices):
    with pytest.raises(
        GhostvisError,
        match=rf"config config.{key}: '{value}' is not one of {choices}; "
        rf"set one of them \(e.g. --set {key}=",
    ):
        presets.resolve("pretrain", "tiny", {key: value})


def test_the_evidence_names_are_typed_and_each_is_measured_by_the_trainer():
    """eval.evidence is checked when the config is built (a list of names, so the example sets a list), and
    every name it accepts is one the trainer measures (run/train/evidence.py)."""
    from typing import get_args

    from ghostvis_core.plan.config import Evidence
    from ghostvis_core.run.train.evidence import EVIDENCE

    assert list(EVIDENCE) == list(get_args(Evidence))
    with pytest.raises(
        GhostvisError,
        match=r"config config.eval.evidence\[1\]: 'loss_curve' is not one of domain_loss, beyond_context_loss, "
        r"reasoning, caption_image_gap, reply_endings, reward; set one of them "
        r'\(e.g. --set eval.evidence=\["domain_loss"\]\)',
    ):
        presets.resolve("sft", "tiny", {"eval.evidence": '["reply_endings", "loss_curve"]'})


def test_presets_are_resolved_once_per_stage_and_preset(monkeypatch):
    monkeypatch.setenv("GHOSTVIS_LINEAGE", "vlm")  # every stage on the one below it
    presets._preset_config.cache_clear()
    presets.resolve("rl", "smoke")
    assert presets._preset_config.cache_info().misses == len(stages.STAGES) - 1  # each upstream stage once
    presets.resolve("dpo", "smoke")
    assert presets._preset_config.cache_info().misses == len(stages.STAGES) - 1


WEB = (
    ShardRef("web/00001", "web", "train", "s3://b/tok/web/00001.arrow", 3, 700, "sha-1"),
    ShardRef("web/00000", "web", "train", "s3://b/tok/web/00000.arrow", 2, 500, "sha-0"),
)
HELD_OUT = (ShardRef("web/00002", "web", "validation", "s3://b/tok/web/00002.arrow", 1, 90, "sha-2"),)


def launch_spec(cfg: StageConfig) -> LaunchSpec:
    """A spec of the stage's config over the WEB shards, as start_run builds one."""
    return launch_record(
        cfg.stage,
        f"{cfg.stage}-0123456789-r1",
        cfg,
        plan(cfg),
        train_shards={"web": WEB},
        val_shards={"web": HELD_OUT},
        inputs=StageInputs(stream_offsets={"web": 512}, reward_rules={"web": "integer"}),
    )


def test_the_launch_spec_round_trips_its_typed_config_and_plan(tmp_path):
    """Every stage's spec, shards typed, comes back equal from its saved JSON; the plan holds its one BatchPlan and
    is saved flat (the four factors at the top of `plan`, where the audit reads them); nothing can be set on it."""
    for stage in stages.stage_names():
        cfg = presets.resolve(stage, "smoke")
        assert StageConfig.from_dict(json.loads(cfg.to_json())) == cfg
        spec = launch_spec(cfg)
        p = spec.plan
        saved = spec.to_json()
        back = LaunchSpec.from_dict(json.loads(saved))
        assert back == spec and isinstance(back.config, StageConfig) and isinstance(back.plan, Plan)
        assert back.train_shards["web"] == WEB and back.val_shards["web"][0].tokens == 90
        assert back.to_json() == saved  # byte for byte
        assert back.plan.batch == p.batch
        flat = json.loads(saved)["plan"]
        assert [flat[k] for k in ("micro_batch_size", "seq_len", "world_size", "grad_accum_steps")] == [
            p.batch.micro_batch_size,
            p.batch.seq_len,
            p.batch.world_size,
            p.batch.grad_accum_steps,
        ]
        assert flat["tokens_per_step"] == p.batch.tokens_per_step and "batch" not in flat
        assert back.shard_versions() == {"web/00000": "sha-0", "web/00001": "sha-1", "web/00002": "sha-2"}
        with pytest.raises(dataclasses.FrozenInstanceError):
            back.run_key = "another"
        with pytest.raises(dataclasses.FrozenInstanceError):
            back.inputs.old_seq_len = 1
        with pytest.raises(dataclasses.FrozenInstanceError):
            back.train_shards["web"][0].path = "/local"
    older = json.loads(saved)  # as a GhostVis before the pre-flight record saved it
    older["inputs"]["source_budget"] = {"web": {"tokens": 1200}}
    store = open_store(str(tmp_path / "store"))
    store.write_json("run_spec", spec.stage, spec.run_key, data=json.loads(saved))
    assert LaunchSpec.read(store, spec.stage, spec.run_key) == spec
    store.write_json("run_spec", spec.stage, spec.run_key, data=older)
    with pytest.raises(GhostvisError, match=rf"run {spec.run_key}: its launch record .*source_budget.*older version"):
        LaunchSpec.read(store, spec.stage, spec.run_key)


def test_a_launch_record_is_never_overwritten_and_a_resume_launched_otherwise_saves_its_own(store_nodes):
    """On both stores: the first launch saves spec.json; a resume launched as saved writes nothing; one on another
    world size (the same run: the identity leaves the rank split out) saves spec.2.json and leaves spec.json's bytes
    as they were; the job, given spec.json's URI as every launcher gives it, and every reader read the newest."""
    from ghostvis_core.run.__main__ import read_spec
    from ghostvis_core.runs.launch_spec import launch_records, saved_spec

    store, other_node = store_nodes.writer, store_nodes.reader
    first = launch_spec(presets.resolve("pretrain", "smoke"))
    on_one = launch_spec(presets.resolve("pretrain", "smoke", {"batch.world_size": "1", "batch.grad_accum_steps": "2"}))
    assert (first.plan.batch.world_size, on_one.plan.batch.world_size) == (2, 1)
    assert first.plan.batch.tokens_per_step == on_one.plan.batch.tokens_per_step
    key = (first.stage, first.run_key)
    assert first.save(store) == store.uri_of("run_spec", *key) == store_nodes.located(f"runs/{'/'.join(key)}/spec.json")
    saved = store.read_text("run_spec", *key)
    assert first.save(store) is None and launch_records(store, *key) == [("run_spec", *key)]  # as saved: nothing
    assert on_one.save(store) == store.uri_of("run_spec_resume", *key, "2")
    assert other_node.read_text("run_spec", *key) == saved  # the first launch's record, byte for byte
    assert LaunchSpec.from_dict(other_node.read_json("run_spec_resume", *key, "2")) == on_one
    assert LaunchSpec.read(other_node, *key) == read_spec(store.uri_of("run_spec", *key)) == on_one
    assert saved_spec(other_node, *key) == on_one.to_dict()
    assert on_one.save(store) is None  # the newest again: nothing
    assert first.save(store) == store.uri_of("run_spec_resume", *key, "3")  # back on 2 ranks: a third record
    assert LaunchSpec.read(other_node, *key) == first and other_node.read_text("run_spec", *key) == saved
    assert [k[-1] for k in launch_records(other_node, *key)] == [first.run_key, "2", "3"]


def test_the_preflight_record_round_trips_in_the_two_shapes_of_its_file(tmp_path):
    """What the job's pre-flight found is a record of its own (preflight.json): the budget per source when it
    passed, the refusal when it did not; read back typed, as the materialization reads it."""
    from ghostvis_core.runs.preflight_findings import PreflightRecord, SourceBudget, preflight_record
    from ghostvis_core.store import FolderStore

    store = FolderStore(tmp_path / "store")
    assert preflight_record(store, "pretrain", "k-r1") is None  # before the job ran
    passed = PreflightRecord(7, "node-1", {"web": SourceBudget(100, 200, 2, 0.5)})
    passed.save(store, "pretrain", "k-r1")
    assert store.read_json("run_file", "pretrain", "k-r1", "preflight.json") == {
        "pid": 7,
        "host": "node-1",
        "source_budget": {"web": {"needed_tokens": 100, "available_tokens": 200, "shards": 2, "epochs": 0.5}},
    }
    assert preflight_record(store, "pretrain", "k-r1") == passed
    refused = PreflightRecord(8, "node-2", refused="pre-flight failed: source web ...")
    refused.save(store, "pretrain", "k-r2")
    assert store.read_json("run_file", "pretrain", "k-r2", "preflight.json") == {
        "pid": 8,
        "host": "node-2",
        "refused": "pre-flight failed: source web ...",
    }
    assert preflight_record(store, "pretrain", "k-r2") == refused

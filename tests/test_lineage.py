"""The lineage (GHOSTVIS_LINEAGE): which stages a model goes through and what each starts from, from the
selection to the Dagster graph, the resolved configs, the launch refusal and the quality gate."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from ghostvis_core.errors import GhostvisError
from ghostvis_core.plan import lineage, presets, selected
from ghostvis_core.plan.stages import stage_names
from ghostvis_core.verify.eval.quality_gate import gate_rows


def test_named_lineages():
    vlm, llm, chat = lineage.parse("vlm"), lineage.parse("llm"), lineage.parse("chat")
    assert vlm.stage_names() == stage_names()
    assert llm.stage_names() == [s for s in stage_names() if s != "vision_alignment"]
    assert llm.upstream("sft") == "reasoning_mix" and vlm.upstream("sft") == "vision_alignment"
    assert llm.below("rl") == ["dpo", "sft", "reasoning_mix", "context_expansion", "continued_pretrain", "pretrain"]
    assert chat.starts == (("sft", None), ("dpo", "sft"), ("rl", "dpo"))
    assert chat.needs_model("sft") and not chat.needs_model("dpo") and not vlm.needs_model("pretrain")
    assert chat.describe() == "sft <- the init_from model; dpo <- sft; rl <- dpo"


def test_a_listed_lineage_starts_each_stage_from_the_nearest_listed_one_or_the_one_named():
    chain = lineage.parse("pretrain, sft, dpo, rl<sft")
    assert chain.starts == (("pretrain", None), ("sft", "pretrain"), ("dpo", "sft"), ("rl", "sft"))
    assert chain.below("rl") == ["sft", "pretrain"]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("pretrain,sfft", "unknown stage 'sfft'; stages are pretrain, continued_pretrain"),
        ("sft,pretrain", "pretrain is listed twice or out of chain order"),
        ("pretrain,sft,sft", "sft is listed twice or out of chain order"),
        ("pretrain,rl<dpo", "rl starts from 'dpo', which is not listed before it"),
        (" , ", "lists no stage"),
    ],
)
def test_a_lineage_that_cannot_train_is_refused_naming_the_fix(spec, message):
    with pytest.raises(GhostvisError, match=message):
        lineage.parse(spec)


def test_the_tiny_preset_starts_rl_on_reasoning_mix_and_its_chat_stages_are_sft_and_dpo(monkeypatch):
    monkeypatch.delenv("GHOSTVIS_LINEAGE", raising=False)
    monkeypatch.setenv("GHOSTVIS_PRESET", "tiny")
    demo = selected.lineage()
    assert demo.name == "demo" and demo.stage_names() == stage_names()
    assert demo.upstream("rl") == "reasoning_mix" and demo.upstream("dpo") == "sft"
    assert demo.chat_stages() == ["sft", "dpo"]  # rl's model never saw the chat template
    cfg = presets.resolve("rl", "tiny")
    assert (cfg.init_from, cfg.grpo.prompt, cfg.vision) == ("reasoning_mix", "text", None)
    monkeypatch.setenv("GHOSTVIS_PRESET", "smoke")  # the smoke preset keeps every stage on the one below
    assert selected.lineage().name == "vlm" and selected.lineage().chat_stages() == ["sft", "dpo", "rl"]
    assert presets.resolve("rl", "smoke").grpo.prompt == "chat"
    monkeypatch.setenv("GHOSTVIS_LINEAGE", "llm")  # set, it wins over the preset's
    assert selected.lineage().upstream("rl") == "dpo"


def test_a_stage_outside_the_lineage_is_refused_naming_it(monkeypatch):
    monkeypatch.setenv("GHOSTVIS_LINEAGE", "llm")
    with pytest.raises(GhostvisError, match="stage vision_alignment is not in the lineage llm .*add it to GHOSTVIS"):
        selected.lineage().upstream("vision_alignment")


def test_a_text_only_lineage_resolves_sft_on_the_text_model(monkeypatch):
    vlm_sft = presets.resolve("sft", "tiny")
    assert vlm_sft.init_from == "vision_alignment" and vlm_sft.vision is not None
    monkeypatch.setenv("GHOSTVIS_LINEAGE", "llm")
    llm_sft = presets.resolve("sft", "tiny")
    assert llm_sft.init_from == "reasoning_mix"
    assert llm_sft.vision is None  # inherited from reasoning_mix, not from the skipped vision stage
    assert presets.resolve("rl", "tiny").init_from == "dpo"


def test_the_first_stage_of_a_lineage_needs_a_model_to_start_from(monkeypatch):
    from ghostvis_core.launch.start import resolve_stage

    monkeypatch.setenv("GHOSTVIS_LINEAGE", "chat")
    with pytest.raises(GhostvisError, match="stage sft starts the lineage chat .* set init_from to a Hugging Face"):
        resolve_stage("sft", "tiny", {}, home=None, tokenizer_id=None, upstream=None)


def test_the_gate_compares_a_stage_with_the_stage_it_started_from(monkeypatch):
    bpb = {s: {"web": 1.0 + i / 10} for i, s in enumerate(["reasoning_mix", "vision_alignment", "sft"])}
    tol = dict.fromkeys(bpb, 0.1)
    assert {(r.stage, r.upstream) for r in gate_rows(bpb, tol)} == {
        ("vision_alignment", "reasoning_mix"),
        ("sft", "vision_alignment"),
    }
    monkeypatch.setenv("GHOSTVIS_LINEAGE", "llm")
    del bpb["vision_alignment"]
    assert [(r.stage, r.upstream, round(r.ratio, 3)) for r in gate_rows(bpb, tol)] == [("sft", "reasoning_mix", 1.2)]


def test_the_dagster_graph_holds_the_selected_lineage():
    """The code location as `dagster dev` loads it with GHOSTVIS_LINEAGE=llm (its own process: the graph is
    built at import): no vision asset or check, sft on top of reasoning_mix, the training job over the seven."""
    code = """if True:
        import json
        from dagster import AssetKey
        from ghostvis_pipeline.definitions import defs
        g = defs.resolve_asset_graph()
        sft, job = g.get(AssetKey("sft")), defs.get_job_def("training")
        print(json.dumps({
            "keys": sorted(k.to_user_string() for k in g.get_all_asset_keys()),
            "sft_deps": sorted(k.to_user_string() for k in sft.parent_keys),
            "sft_description": sft.description,
            "checks": sorted({c.asset_key.to_user_string() for c in g.asset_check_keys}),
            "training": sorted(k.to_user_string() for k in job.asset_layer.selected_asset_keys),
        }))
    """
    env = {**os.environ, "GHOSTVIS_LINEAGE": "llm"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    graph = json.loads(out.splitlines()[-1])
    assert "vision_alignment" not in graph["keys"] and "vision_alignment" not in graph["checks"]
    assert {"pretrain", "reasoning_mix", "sft", "dpo", "rl", "evaluation", "report"} <= set(graph["keys"])
    assert graph["sft_deps"] == sorted(
        ["token_ledger", "tokenizer", "reasoning_mix", "context_expansion", "continued_pretrain", "pretrain"]
    )
    assert graph["sft_description"].endswith("Lineage llm: starts from reasoning_mix.")
    assert graph["training"] == sorted(s for s in stage_names() if s != "vision_alignment")


@pytest.mark.e2e
def test_a_text_only_lineage_fine_tunes_without_vision_and_chat_opens_any_chat_stage(home_copy):
    """On the demo home (every stage of the vlm lineage trained), `GHOSTVIS_LINEAGE=llm ghostvis train sft`
    trains sft on top of reasoning_mix with no vision stack: a new run identity whose parent is
    reasoning_mix's run, audited clean; the skipped stage cannot be launched; `ghostvis chat` opens rl by
    default (the lineage's newest chat stage) and the new sft run by key."""
    from ghostvis_core.home import Home
    from ghostvis_core.run.trained_model import stage_config
    from ghostvis_core.runs.launch_spec import LaunchSpec
    from ghostvis_core.runs.lookup import newest_completed_run, run_result
    from tests.conftest import BIN, cli_env, run_cli

    store = Home(home_copy).store
    vlm_sft, reasoning = (newest_completed_run(store, s) for s in ("sft", "reasoning_mix"))
    out = run_cli(["ghostvis", "train", "sft", "--set", "budget.steps=2"], home_copy, GHOSTVIS_LINEAGE="llm").stdout
    key = re.search(r"^sft: run (\S+),", out, re.M).group(1)
    assert key != vlm_sft.run_key and "\ncached: " not in out
    spec = LaunchSpec.from_dict(store.read_json("run_spec", "sft", key))
    assert spec.parent_run_key == reasoning.run_key and spec.tags["ghostvis.upstream_stage"] == "reasoning_mix"
    cfg = stage_config(store, run_result(store, "sft", key))
    assert cfg.init_from == "reasoning_mix" and cfg.vision is None
    run_cli(["ghostvis", "audit", "--stage", "sft", "--no-dagster"], home_copy, GHOSTVIS_LINEAGE="llm")

    refused = run_cli(["ghostvis", "train", "vision_alignment"], home_copy, check=False, GHOSTVIS_LINEAGE="llm")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "stage vision_alignment is not in the lineage llm" in refused.stderr

    def chat(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(BIN / "ghostvis"), "chat", "--max-tokens", "4", *args],
            input="What is 2 + 3?\n",
            env=cli_env(home_copy, GHOSTVIS_LINEAGE="llm"),
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )

    rl = newest_completed_run(store, "rl")
    default = chat()
    assert default.stderr.startswith(f"rl ({rl.run_key})") and len(default.stdout.splitlines()) == 1, default
    fine_tuned = chat("--stage", "sft", "--run", key)
    assert fine_tuned.stderr.startswith(f"sft ({key})") and len(fine_tuned.stdout.splitlines()) == 1, fine_tuned

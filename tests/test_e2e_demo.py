"""End to end through the real CLIs: `ghostvis demo` (smoke preset), then `dagster asset
materialize` of single stages, and the numbers in the ledger, MLflow and Dagster compared."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ghostvis_core.counts import MLFLOW_METRICS, TokenCounts
from ghostvis_core.data.ledger import Ledger
from ghostvis_core.errors import GhostvisError
from ghostvis_core.home import Home
from ghostvis_core.launch.cluster.torchrun_command import AGENT_MODULE
from ghostvis_core.plan import presets, stages
from ghostvis_core.plan.budget import flops_per_token, plan
from ghostvis_core.plan.stages import stage_names
from ghostvis_core.verify.audit.data_checks import DATA_CHECKS
from ghostvis_core.verify.audit.stage_checks import stage_check_names
from ghostvis_core.verify.replay.refusal import REPLAYABLE_OBJECTIVES
from tests.conftest import materialize, run_cli, torchrun_stage

pytestmark = pytest.mark.e2e

STAGES = stage_names()
REPLAYED = [s for s in STAGES if stages.stage(s).objective in REPLAYABLE_OBJECTIVES]  # each has a replay_matches check


def dagster_instance(home):
    from dagster import DagsterInstance

    os.environ["DAGSTER_HOME"] = str(home / "dagster")
    return DagsterInstance.get()


def latest(instance, asset: str) -> dict:
    from dagster import AssetKey

    ev = instance.get_latest_materialization_event(AssetKey(asset))
    return {k: getattr(v, "value", v) for k, v in ev.asset_materialization.metadata.items()}


def mlflow_runs(home):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(Home(home).mlflow_tracking_uri)
    exp = client.get_experiment_by_name("ghostvis")
    return client, client.search_runs([exp.experiment_id], max_results=500)


def test_demo_materializes_every_asset_and_all_checks_pass(demo_home):
    out = (demo_home / "demo_stdout.txt").read_text()
    for asset in ["shard_manifest", "raw_shards", "tokenizer", "tokenized_shards", "token_ledger", *STAGES]:
        assert f"\n{asset} " in out, f"{asset} missing from the per-asset breakdown:\n{out}"
    line = next(line for line in out.splitlines() if line.startswith("checks:"))
    passed, total = map(int, line.split()[1].split("/"))
    # 5 data checks (4 ledger, 1 tokenizer), the stages' checks and the evaluation's lineage quality gate
    # the tokenizer's check, the ledger's data checks, every stage's checks, the replayable stages' replay_matches,
    # the lineage quality gate
    assert passed == total == 1 + len(DATA_CHECKS) + len(stage_check_names()) * len(STAGES) + len(REPLAYED) + 1, line


def test_ledger_mlflow_and_dagster_agree_to_the_token_for_every_stage(demo_home):
    instance = dagster_instance(demo_home)
    ledger = Ledger.in_store(Home(demo_home).store)
    client, runs = mlflow_runs(demo_home)
    for stage in STAGES:
        md = latest(instance, stage)
        totals = ledger.run_totals(md["run_key"])
        metrics = client.get_run(md["mlflow_run_id"]).data.metrics
        cfg = presets.resolve(stage, "smoke")
        p = plan(cfg)
        assert md["steps"] == totals.steps == p.steps
        assert md["real_tokens"] + md["pad_tokens"] == p.steps * p.batch.tokens_per_step == md["planned_tokens"]
        assert md["tokens_per_step"] == (
            md["micro_batch_size"] * md["seq_len"] * md["world_size"] * md["grad_accum_steps"]
        )
        for key, metric in MLFLOW_METRICS.items():
            assert md[key] == getattr(totals.counts, key) == int(metrics[metric]), (stage, key)
        # the pieces read from shards are exactly the tokens trained (+ cropped; DPO reads its prompt once
        # for two rows, an image is n_latents positions for one token)
        consumed = sum(r.tokens for r in ledger.consumed_by_shard(md["run_key"]))
        if cfg.objective == "lm":
            assert consumed == md["real_tokens"]
        elif cfg.objective == "sft":  # each image chat's one <|image|> token filled n_latents positions
            extra = md["real_tokens"] + md["cropped_tokens"] - consumed
            assert extra >= 0 and extra % (cfg.vision.n_latents - 1) == 0
    # one MLflow run per stage, tagged with the stage and its lineage
    by_stage = {r.data.tags["ghostvis.stage"]: r for r in runs}
    assert set(by_stage) == set(STAGES)
    for stage in STAGES:
        up = presets.resolve(stage, "smoke").init_from
        if up:
            assert by_stage[stage].data.tags["ghostvis.parent_run_key"] == by_stage[up].data.tags["ghostvis.run_key"]


def test_pretraining_lowers_validation_loss_and_mixture_follows_the_recipe(demo_home):
    instance = dagster_instance(demo_home)
    md = latest(instance, "pretrain")
    assert md["val_loss"] < md["val_loss_start"] - 0.8, md  # ln(4096) = 8.3 at the start
    cp = latest(instance, "continued_pretrain")
    # 8 steps x 8 rows: the 0.7/0.3 schedule gives exactly 45/19 rows of 256 tokens
    assert cp["mixture/demo_code/tokens"] == 45 * 256 and cp["mixture/demo_prose/tokens"] == 19 * 256
    assert cp["domain_loss_after"] < cp["domain_loss_before"]
    # continued_pretrain starts where pretrain stopped reading each source: no undeclared reuse
    ledger = Ledger.in_store(Home(demo_home).store)
    assert not [r for r in ledger.reuse(cp["run_key"]) if r.kind != "replay"]
    rm = latest(instance, "reasoning_mix")
    replay = [r for r in ledger.reuse(rm["run_key"]) if r.kind == "replay"]
    # its replay of the earlier text is declared (ghostvis_core/plan/presets.py): shown as replay, not reuse
    assert replay and {r.source for r in replay} == {"demo_prose", "demo_code"}


def test_context_expansion_lowers_the_held_out_loss_beyond_and_within_the_old_context(demo_home):
    """The stage's evidence moves its way in the smoke demo: held-out loss at positions beyond the upstream's 256
    falls, and so does the loss within them (smoke warms up in 1 step, presets.py `_SMOKE_DELTAS`)."""
    ce = latest(dagster_instance(demo_home), "context_expansion")
    assert ce["loss_beyond_context_after"] < ce["loss_beyond_context_before"], ce
    assert ce["loss_within_context_after"] < ce["loss_within_context_before"], ce


def test_rematerializing_one_stage_through_the_dagster_cli(home_copy):
    """With force: true (the same inputs are otherwise a cache hit, test_cache.py): a new attempt of the
    same run identity, with its own MLflow run, that packs exactly the same tokens. On a copy: the stages
    above sft would otherwise be unsynced for every later test of the shared demo home."""
    instance = dagster_instance(home_copy)
    before = latest(instance, "sft")
    vision = latest(instance, "vision_alignment")
    proc = run_cli(materialize("sft", config={"ops": {"sft": {"config": {"force": True}}}}), home_copy)
    assert "RUN_SUCCESS" in proc.stdout + proc.stderr
    after = latest(dagster_instance(home_copy), "sft")
    assert after["run_key"] == before["run_key"][: -len("-r1")] + "-r2" and "cached_from" not in after
    assert after["mlflow_run_id"] != before["mlflow_run_id"]
    assert after["parent_run_key"] == vision["run_key"]  # from the stored upstream checkpoint
    assert after["real_tokens"] == before["real_tokens"]  # same config, same data, deterministic packing
    assert (
        Ledger.in_store(Home(home_copy).store).run_totals(after["run_key"]).counts.real_tokens == after["real_tokens"]
    )


def test_ghostvis_ledger_json_shows_the_same_totals(demo_home):
    proc = run_cli(["ghostvis", "ledger", "--json"], demo_home)
    report = json.loads(proc.stdout)
    instance = dagster_instance(demo_home)
    runs = {r["run_key"]: r for r in report["runs"]}
    for stage in STAGES:
        md = latest(instance, stage)
        assert runs[md["run_key"]]["real_tokens"] == md["real_tokens"]
    tl = latest(instance, "token_ledger")
    assert sum(r["tokens"] for r in report["shards"]) == tl["tokens"]
    assert len(report["shards"]) == tl["shards"] == 35  # 7 sources x (4 train + 1 validation)


def test_a_stage_whose_upstream_is_missing_says_which_asset_to_materialize_first(home_copy):
    run_cli(["dagster", "asset", "wipe", "sft", "--noprompt"], home_copy)
    proc = run_cli(
        ["dagster", "asset", "materialize", "--select", "dpo", "-m", "ghostvis_pipeline.definitions"],
        home_copy,
        check=False,
    )
    assert proc.returncode != 0
    assert "asset `sft` has never been materialized; materialize it first" in proc.stdout + proc.stderr
    assert AGENT_MODULE not in proc.stdout + proc.stderr  # refused before launching torchrun
    # the same when the upstream's checkpoint files are gone (core path, no Dagster)
    from ghostvis_core.launch.start import prepare_run
    from ghostvis_core.runs.lookup import Upstream

    with pytest.raises(GhostvisError, match=r"upstream checkpoint .* is missing; materialize the `sft` asset first"):
        prepare_run(
            "dpo",
            preset="smoke",
            home=Home(home_copy),
            upstream=Upstream("sft", "sft-x-r1", str(home_copy / "nowhere" / "step_000000008")),
        )


def test_a_config_inconsistent_with_the_upstream_checkpoint_fails_before_torchrun(home_copy):
    from ghostvis_core.launch.start import prepare_run

    with pytest.raises(GhostvisError, match=r"model.d_model=512 \(upstream context_expansion has 256\)"):
        prepare_run("reasoning_mix", preset="smoke", home=Home(home_copy), overrides={"model.d_model": "512"})
    with pytest.raises(GhostvisError, match=r"batch.seq_len=2048 exceeds model.max_seq_len=1024 .* context_expansion"):
        prepare_run("sft", preset="smoke", home=Home(home_copy), overrides={"batch.seq_len": "2048"})


def test_plain_torchrun_runs_a_stage_without_dagster(home_copy):
    proc = run_cli(
        torchrun_stage(home_copy, "pretrain", "budget.steps=4", OMP_NUM_THREADS="1"),
        home_copy,
        OMP_NUM_THREADS="1",
    )
    assert "step 4/4" in proc.stdout
    ledger = Ledger.in_store(Home(home_copy).store)
    runs = [p for p in ledger.parts(stage="pretrain") if p.step_last == 4 and p.world_size == 2]
    assert runs
    totals = ledger.run_totals(runs[-1].run_key)
    assert totals.counts.real_tokens == 4 * 4 * 256 * 2 and totals.overlap_tokens == 0  # 4 steps of the smoke batch
    # the consumed token ranges of the two ranks tile exactly the trained tokens
    assert sum(r.tokens for r in ledger.consumed_by_shard(runs[-1].run_key)) == totals.counts.real_tokens


def test_report_card_token_figures_equal_the_ledger_and_evidence_is_listed(demo_home):
    instance = dagster_instance(demo_home)
    md = latest(instance, "report")
    html = Path(md["report_html"]).read_text()
    rows = json.loads(Path(md["report_html"]).with_name("report.json").read_text())
    ledger = Ledger.in_store(Home(demo_home).store)
    assert [r["stage"] for r in rows] == STAGES
    for r in rows:
        totals = ledger.run_totals(r["run_key"])
        for key in TokenCounts.names():
            assert r["totals"][key] == getattr(totals.counts, key)
        assert f"data-stage='{r['stage']}'" in html and f"{totals.counts.real_tokens:,}" in html
    assert (Path(md["report_html"]).parent / "loss_curves.png").stat().st_size > 10_000
    assert "preference_accuracy" in html and "caption_image_gap" in html and "H100" in html
    assert "evidence improve?</h2>" in html  # per stage whether its evidence improved, and why not
    ev = latest(instance, "evaluation")
    assert ev["mc_chance"] == 0.25 and "dpo" in ev["evaluation"]


def test_measured_mfu_is_one_figure_in_dagster_mlflow_and_the_report(demo_home):
    """Per stage: the FLOPs per token are the planner's formula for the stage's model and context, MFU is
    tokens/s x FLOPs per token over the ranks' measured CPU matmul peak, and a run's figures are the
    same in Dagster's metadata, the last MLflow point and the report (each compared with its own run:
    another test of this module re-materializes sft after the report was made)."""
    instance = dagster_instance(demo_home)
    client, _ = mlflow_runs(demo_home)

    def last_point(mlflow_run_id: str) -> tuple[float, float]:
        m = client.get_run(mlflow_run_id).data.metrics
        return round(m["throughput/mfu"], 5), round(m["throughput/tokens_per_sec"], 1)

    for stage in STAGES:
        md = latest(instance, stage)
        cfg = presets.resolve(stage, "smoke")
        assert md["flops_per_token"] == flops_per_token(cfg.model, cfg.batch.seq_len), stage
        assert md["peak_flops_source"] == "measured:cpu" and md["peak_flops"] > 1e9, stage
        by_hand = md["tokens_per_sec"] * md["flops_per_token"] / (md["world_size"] * md["peak_flops"])
        assert 0 < md["mfu"] == pytest.approx(by_hand, rel=1e-3, abs=1e-5), stage
        assert last_point(md["mlflow_run_id"]) == (md["mfu"], md["tokens_per_sec"]), stage
    report = latest(instance, "report")
    rows = json.loads(Path(report["report_html"]).with_name("report.json").read_text())
    assert [r["stage"] for r in rows] == STAGES
    for r in rows:
        assert last_point(r["mlflow_run_id"]) == (r["mfu"], r["tokens_per_sec"]), r["stage"]


SHORT_VARIANTS = {"ops": {"pretrain_variants": {"config": {"overrides": {"budget.steps": "8"}}}}}


def test_variant_backfill_gives_comparable_mlflow_runs_at_equal_tokens(home_copy):
    for variant in presets.VARIANTS["pretrain"]:
        run_cli(materialize("pretrain_variants", "--partition", variant, config=SHORT_VARIANTS), home_copy)
    client, runs = mlflow_runs(home_copy)
    by_variant = {r.data.tags["ghostvis.variant"]: r for r in runs if "ghostvis.variant" in r.data.tags}
    assert set(by_variant) == set(presets.VARIANTS["pretrain"])
    lrs = {v: float(r.data.params["optim.lr"]) for v, r in by_variant.items() if v.startswith("lr_")}
    assert lrs == {v: float(o["optim.lr"]) for v, o in presets.VARIANTS["pretrain"].items() if v.startswith("lr_")}
    assert {v: r.data.params["optim.name"] for v, r in by_variant.items()} == {
        "lr_1e-3": "adamw",
        "lr_4e-3": "adamw",
        "muon": "muon",
    }
    for r in by_variant.values():
        assert {"train/loss", "val/loss", "tokens/real"} <= set(r.data.metrics)
        assert r.data.tags["ghostvis.stage"] == "pretrain" and r.data.tags["ghostvis.run_key"].startswith("pretrain@")
    # same budget, different lr or optimizer: AdamW and Muon compared at equal tokens
    assert len({r.data.metrics["tokens/real"] for r in by_variant.values()}) == 1
    assert len({r.data.metrics["val/loss"] for r in by_variant.values()}) == len(by_variant)
    # a variant never becomes the upstream of the main chain
    from ghostvis_core.runs.lookup import find_upstream

    assert "@" not in find_upstream(Home(home_copy).store, "pretrain").run_key


def test_chat_answers_piped_prompts_and_exits_cleanly(demo_home):
    import subprocess

    from tests.conftest import BIN, cli_env

    proc = subprocess.run(
        [str(BIN / "ghostvis"), "chat", "--stage", "sft", "--max-tokens", "24"],
        input="What is 2 + 3?\nSay hello to Ada.\n",
        env=cli_env(demo_home),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.splitlines()) == 2  # one reply line per prompt, then EOF ends the session
    assert "<|" not in proc.stdout  # a special token ends a reply and is never printed

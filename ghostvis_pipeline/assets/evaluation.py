"""Eval assets: `evaluation` scores every stage of the lineage on the same held-out data and logs to
each stage's MLflow run; `report` writes the lineage's report card (HTML + Markdown + PNG), logs it
to MLflow and links it from Dagster."""

import json
import time

from dagster import AssetExecutionContext, Config, MaterializeResult, MetadataValue, asset

from ghostvis_core.budget import DEFAULT_GPU_PRICES
from ghostvis_core.data.ledger import Ledger, held_out_text_shards
from ghostvis_core.eval.benchmark import PROMPTS, bits_per_byte, build_items, multiple_choice, samples
from ghostvis_core.eval.checkpoints import load_stage, stage_config
from ghostvis_core.eval.report import stage_report, write_report
from ghostvis_core.stages import stage_names
from ghostvis_core.store import LocalStore
from ghostvis_core.track.mlflow_records import add_files, add_to_run, metric_histories
from ghostvis_core.train.runs import run_result
from ghostvis_pipeline.metadata import latest_metadata, md_table
from ghostvis_pipeline.resources import GhostvisHome

STAGES = stage_names()


def lineage_run_keys(context) -> dict[str, str]:
    """The run key of each stage's newest materialization."""
    return {s: latest_metadata(context, s)["run_key"] for s in STAGES}


def eval_shards(store: LocalStore, tokenizer_id: str, lineage: dict[str, str]) -> dict[str, list[dict]]:
    """The held-out plain-text shards every stage is scored on: the validation sources of the
    lineage's first stage (its data.val_sources, in that order) that have text validation shards
    in the ledger for the tokenizer."""
    first = next(iter(lineage))
    sources = stage_config(store, run_result(store, first, lineage[first])).data.val_sources
    return held_out_text_shards(Ledger.in_store(store), tokenizer_id, sources)


@asset(group_name="eval", kinds={"torch", "mlflow"}, owners=["team:training"], deps=STAGES)
def evaluation(context: AssetExecutionContext, home: GhostvisHome) -> MaterializeResult:
    """Validation bits per byte, a multiple-choice benchmark (lowest answer loss wins) and sampled
    completions for fixed prompts, for every stage's newest checkpoint."""
    h = home.home()
    lineage = lineage_run_keys(context)
    val = eval_shards(h.store, latest_metadata(context, "tokenizer")["tokenizer_id"], lineage)
    results, rows = {}, []
    for stage, run_key in lineage.items():
        t0 = time.time()
        ts = load_stage(h, stage, run_key)
        bpb = bits_per_byte(ts, val, max_tokens=8192)
        mc = multiple_choice(ts, build_items(ts, val, per_task=25))
        smp = samples(ts)
        results[stage] = {"run_key": run_key, "bpb": bpb, "mc": mc, "samples": smp}
        metrics = {f"eval/bpb/{k}": v for k, v in bpb.items()} | {f"eval/mc/{k}": v for k, v in mc.items()}
        add_to_run(h.mlflow_tracking_uri, ts.result.mlflow_run_id, metrics, ts.result.steps,
                   texts={"eval/samples.json": json.dumps(smp, indent=2)})
        rows.append([stage, run_key, *[f"{bpb.get(s, float('nan')):.3f}" for s in val], f"{mc['overall']:.2f}",
                     smp[0]["completion"].strip()[:60]])
        context.log.info(f"{stage}: bpb {bpb}, mc {mc['overall']:.2f} ({time.time() - t0:.1f}s)")
    path = h.store.write_text("report", "evaluation.json", text=json.dumps(results, indent=2))
    return MaterializeResult(metadata={
        "evaluation": MetadataValue.md(md_table(
            ["stage", "run", *[f"bpb {s}" for s in val], "mc accuracy", f"'{PROMPTS[0]}'"],
            rows)),
        "mc_chance": 0.25,
        "results": MetadataValue.path(str(path)),
    })


class ReportConfig(Config):
    gpu_prices: dict[str, float] = dict(DEFAULT_GPU_PRICES)  # assumed $/GPU-hour; set your own


@asset(group_name="eval", kinds={"mlflow", "html"}, owners=["team:training"], deps=["evaluation", *STAGES])
def report(context: AssetExecutionContext, config: ReportConfig, home: GhostvisHome) -> MaterializeResult:
    """The lineage's report card: tokens from the ledger, evidence, evaluation, loss curves, cost."""
    store, tracking_uri = home.home().store, home.home().mlflow_tracking_uri
    ledger = Ledger.in_store(store)
    evaluation_results = store.read_json("report", "evaluation.json")
    stages, smp = [], {}
    for stage, run_key in lineage_run_keys(context).items():
        result = run_result(store, stage, run_key)
        curves = metric_histories(tracking_uri, result.mlflow_run_id, ("train/loss", "val/loss"))
        ev = evaluation_results.get(stage, {})
        stages.append(stage_report(ledger, result, stage_config(store, result), curves, ev, dict(config.gpu_prices)))
        smp[stage] = ev.get("samples", [])
    lineage = " -> ".join(f"{s.stage}" for s in stages)
    files = write_report(store, stages[-1].run_key, f"GhostVis report card: {lineage}", stages, smp)
    final_run = stages[-1].mlflow_run_id
    add_files(tracking_uri, final_run, list(files.values()), "report")
    return MaterializeResult(metadata={
        "report_html": MetadataValue.path(str(files["html"])),
        "report_md": MetadataValue.md(files["md"].read_text()),
        "mlflow_run_id": final_run,
        "stages": len(stages),
        "real_tokens_total": sum(s.totals["real_tokens"] for s in stages),
    })

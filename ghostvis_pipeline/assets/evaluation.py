"""Eval assets: `evaluation` has every stage of the lineage scored on the same held-out data by a job
(`python -m ghostvis_core.verify.eval`, launched like training) that logs to each stage's MLflow run, and
reads its scores from the store; `report` writes the lineage's report card (HTML + Markdown + PNG), logs it
to MLflow and links it from Dagster."""

import dataclasses

from dagster import AssetExecutionContext, Config, DataVersion, MaterializeResult, MetadataValue, asset

from ghostvis_core.counts import GRPO_STEP_METRICS
from ghostvis_core.data.eval_texts import PROMPTS
from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.ledger.records import ShardRecord
from ghostvis_core.data.ledger.summaries import held_out_text_shards
from ghostvis_core.home import Home
from ghostvis_core.identity import code_version, digest
from ghostvis_core.plan.budget import DEFAULT_GPU_PRICES
from ghostvis_core.plan.selected import lineage as selected_lineage
from ghostvis_core.run.track.mlflow_records import add_files, metric_histories
from ghostvis_core.run.trained_model import stage_config
from ghostvis_core.runs.lookup import run_result
from ghostvis_core.store import Store
from ghostvis_core.verify.eval.eval_spec import (
    MAX_BPB_TOKENS,
    MC_PER_TASK,
    EvalSpec,
    eval_job,
    held_out_refs,
    results_name,
)
from ghostvis_core.verify.eval.harness_tasks import DEFAULT_TASKS, task_files_digest
from ghostvis_core.verify.eval.quality_gate import tolerances
from ghostvis_core.verify.eval.report_card import stage_report, write_report
from ghostvis_core.verify.eval.seeds import read_seed_moves
from ghostvis_core.verify.replay.record import replay_summary
from ghostvis_pipeline.launchers import Launcher
from ghostvis_pipeline.metadata import latest_metadata, md_table
from ghostvis_pipeline.resources import GhostvisHome

STAGES = selected_lineage().stage_names()  # the code location's lineage (definitions.py)


def lineage_run_keys(context) -> dict[str, str]:
    """The run key of each stage's newest materialization."""
    return {s: latest_metadata(context, s)["run_key"] for s in STAGES}


def eval_shards(store: Store, tokenizer_id: str, lineage: dict[str, str]) -> dict[str, list[ShardRecord]]:
    """The held-out plain-text shards every stage is scored on: the validation sources of the
    lineage's first stage (its data.val_sources, in that order) that have text validation shards
    in the ledger for the tokenizer (the job fetches its own copies of their token files)."""
    first = next(iter(lineage))
    sources = stage_config(store, run_result(store, first, lineage[first])).data.val_sources
    return held_out_text_shards(Ledger.in_store(store), tokenizer_id, sources)


# The modules that make each eval asset (their code_version, ghostvis_core/identity.py).
EVALUATION_CODE = code_version("ghostvis_core.verify.eval.__main__", "ghostvis_core.verify.eval.scoring")
REPORT_CODE = code_version("ghostvis_core.verify.eval.report_card", "ghostvis_core.run.track.mlflow_records")


class EvaluationConfig(Config):
    # lm-evaluation-harness tasks run on every stage: GhostVis's own (ghostvis_core/resources/lm_eval_tasks),
    # the harness's standard ones where this machine has their data, or tasks in harness_include folders
    harness_tasks: list[str] = list(DEFAULT_TASKS)
    harness_include: list[str] = []  # folders of your own task YAML (lm_eval's include_path)
    # stage -> allowed held-out bpb worsening vs its upstream (0.2 = 20%) for the lineage quality gate
    # (the check lineage_quality_gate); unnamed stages keep the stage table's (ghostvis_core/plan/stages.py)
    bpb_tolerance: dict[str, float] = {}


def evaluation_identity(
    store: Store, tokenizer_id: str, lineage: dict[str, str], val: dict, config: EvaluationConfig
) -> dict:
    """What the scores depend on: each stage's run (its data version), the held-out shards by content,
    the tokenizer, the benchmark's settings and the harness tasks (their files by content)."""
    content = {r.shard_id: r.content_sha256 for r in Ledger.in_store(store).shards(tokenizer_id=tokenizer_id)}
    return {
        "lineage": lineage,
        "tokenizer": tokenizer_id,
        "prompts": list(PROMPTS),
        "held_out": {s: [[x.shard_id, content.get(x.shard_id)] for x in shards] for s, shards in val.items()},
        "max_bpb_tokens": MAX_BPB_TOKENS,
        "mc_per_task": MC_PER_TASK,
        "harness_tasks": list(config.harness_tasks),
        "harness_files": task_files_digest(config.harness_include),
    }


# Evaluation and report depend on everything their scores are made of, directly: Dagster marks an asset
# unsynced only when a direct dependency changed (a new tokenizer or ledger, any stage re-trained).
@asset(
    group_name="eval",
    kinds={"torch", "mlflow"},
    owners=["team:training"],
    deps=["tokenizer", "token_ledger", *STAGES],
    code_version=EVALUATION_CODE,
)
def evaluation(
    context: AssetExecutionContext, config: EvaluationConfig, home: GhostvisHome, launcher: Launcher
) -> MaterializeResult:
    """Validation bits per byte, a multiple-choice benchmark (lowest answer loss wins), sampled
    completions for fixed prompts and lm-evaluation-harness tasks, for every stage's newest
    checkpoint, scored by the evaluation job where the launcher runs jobs. A lineage scored before on
    the same held-out data and tasks is not scored again; data version: the identity of what was scored."""
    h = home.home()
    tolerance = tolerances(dict(config.bpb_tolerance))  # refused before scoring when it names no stage
    lineage = lineage_run_keys(context)
    tokenizer_id = latest_metadata(context, "tokenizer")["tokenizer_id"]
    val = eval_shards(h.store, tokenizer_id, lineage)
    key = digest(evaluation_identity(h.store, tokenizer_id, lineage, val, config))
    cached = h.store.exists("report", results_name(key))
    if cached:
        context.log.info(f"evaluation: cache hit, lineage {', '.join(lineage.values())} was scored before ({key})")
    else:
        launch_scoring(context, h, launcher, evaluation_spec(h, key, tokenizer_id, lineage, val, config))
    results = h.store.read_json("report", results_name(key))
    rows = [
        [
            stage,
            r["run_key"],
            *[f"{r['bpb'].get(s, float('nan')):.3f}" for s in val],
            f"{r['mc']['overall']:.2f}",
            r["samples"][0]["completion"].strip()[:60],
        ]
        for stage, r in results.items()
    ]
    md = {
        "evaluation": MetadataValue.md(
            md_table(["stage", "run", *[f"bpb {s}" for s in val], "mc accuracy", f"'{PROMPTS[0]}'"], rows)
        ),
        "harness": MetadataValue.json({stage: r["harness"] for stage, r in results.items()}),
        "harness_table": MetadataValue.md(harness_table(results)),
        "harness_results": MetadataValue.path(h.store.uri_of("report", f"evaluation/{key}/harness")),
        "mc_chance": 0.25,
        "identity": key,
        "bpb_tolerance": MetadataValue.json(tolerance),
        "results": MetadataValue.path(h.store.uri_of("report", results_name(key))),
    }
    if cached:
        md["cached_from"] = MetadataValue.json(
            {
                "identity": key,
                "why": "the same stage runs, held-out shards by "
                "content, tokenizer and benchmark settings were scored before",
            }
        )
    return MaterializeResult(metadata=md, data_version=DataVersion(key))


def evaluation_spec(
    h: Home, key: str, tokenizer_id: str, lineage: dict[str, str], val: dict, config: EvaluationConfig
) -> EvalSpec:
    """What the job scores, and where it writes and logs."""
    return EvalSpec(
        key=key,
        store=h.store.uri,
        mlflow_tracking_uri=h.mlflow_tracking_uri,
        tokenizer_id=tokenizer_id,
        lineage=lineage,
        held_out=held_out_refs(val),
        harness_tasks=list(config.harness_tasks),
        harness_include=list(config.harness_include),
    )


def launch_scoring(context, h: Home, launcher: Launcher, spec: EvalSpec) -> None:
    """The evaluation job (ghostvis_core/verify/eval/__main__.py) on its spec, written once into the store,
    launched where the launcher runs jobs; once it returns, the scores are in the store."""
    job = eval_job(spec)
    h.store.write_json("run_spec", job.stage, job.run_key, data=spec.to_dict())
    launcher.run(context, job, h)


def harness_table(results: dict) -> str:
    """One row per stage and harness task: its metrics as the harness reported them."""
    rows = [
        [stage, task, ", ".join(f"{m} {v:.4g}" for m, v in ms.items())]
        for stage, r in results.items()
        for task, ms in r["harness"].items()
    ]
    return md_table(["stage", "task", "metrics (lm-evaluation-harness)"], rows)


class ReportConfig(Config):
    gpu_prices: dict[str, float] = dict(DEFAULT_GPU_PRICES)  # assumed $/GPU-hour; set your own


@asset(
    group_name="eval",
    kinds={"mlflow", "html"},
    owners=["team:training"],
    deps=["evaluation", "tokenizer", "token_ledger", *STAGES],
    code_version=REPORT_CODE,
)
def report(context: AssetExecutionContext, config: ReportConfig, home: GhostvisHome) -> MaterializeResult:
    """The lineage's report card: tokens from the ledger, evidence, evaluation, loss curves, cost. The
    card of the same lineage, evaluation and prices is not written again; data version: that identity."""
    store, tracking_uri = home.home().store, home.home().mlflow_tracking_uri
    lineage = lineage_run_keys(context)
    evaluated = latest_metadata(context, "evaluation")
    evaluation_key, tolerance = evaluated["identity"], dict(evaluated["bpb_tolerance"])
    seeds = read_seed_moves(store, stage_config(store, run_result(store, *next(iter(lineage.items())))).preset)
    key = digest(
        {
            "lineage": lineage,
            "evaluation": evaluation_key,
            "gpu_prices": dict(config.gpu_prices),
            "bpb_tolerance": tolerance,
            "replay": {stage: replay_summary(store, stage, run_key) for stage, run_key in lineage.items()},
            **({"seeds": seeds} if seeds else {}),  # a seed benchmark kept since: the card says what it found
        }
    )
    name = list(lineage.values())[-1]
    done = store.read_json("identity", "report", name) if store.exists("identity", "report", name) else {}
    if done.get("digest") == key:
        context.log.info(f"report: cache hit, the card of {name} was written for the same inputs ({key})")
        return _report_result(store, name, done["metadata"], key, cached=True)
    evaluation_results = store.read_json("report", results_name(evaluation_key))
    stages, smp = [], {}
    ledger = Ledger.in_store(store)
    for stage, run_key in lineage.items():
        result = run_result(store, stage, run_key)
        curves = metric_histories(tracking_uri, result.mlflow_run_id, ("train/loss", "val/loss", *GRPO_STEP_METRICS))
        ev = evaluation_results.get(stage, {})
        row = stage_report(
            ledger,
            result,
            stage_config(store, result),
            curves,
            ev,
            dict(config.gpu_prices),
            tolerance[stage],
            replay_summary(store, stage, run_key),
        )
        stages.append(dataclasses.replace(row, seed_moves=seeds.get(stage, {})))
        smp[stage] = ev.get("samples", [])
    chain = selected_lineage()
    title = f"GhostVis report card, lineage {chain.name}: {' -> '.join(s.stage for s in stages)}"
    files = write_report(store, name, title, stages, smp)
    add_files(tracking_uri, stages[-1].mlflow_run_id, list(files.values()), "report")
    md = {
        "mlflow_run_id": stages[-1].mlflow_run_id,
        "stages": len(stages),
        "real_tokens_total": sum(s.totals.counts.real_tokens for s in stages),
    }
    store.write_json("identity", "report", name, data={"digest": key, "metadata": md, "code_version": REPORT_CODE})
    return _report_result(store, name, md, key, cached=False)


def _report_result(store: Store, name: str, md: dict, key: str, cached: bool) -> MaterializeResult:
    """The card's metadata (its files where the store is now); data version = the card's identity."""
    out = {
        **md,
        "report_html": MetadataValue.path(store.uri_of("report", f"{name}/report.html")),
        "report_md": MetadataValue.md(store.read_text("report", f"{name}/report.md")),
    }
    if cached:
        out["cached_from"] = MetadataValue.json({"identity": key, "why": "the same lineage, evaluation and prices"})
    return MaterializeResult(metadata=out, data_version=DataVersion(key))

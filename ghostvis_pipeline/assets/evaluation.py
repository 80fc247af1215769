"""Eval assets: `evaluation` scores every stage of the lineage on the same held-out data and logs to
each stage's MLflow run; `report` writes the lineage's report card (HTML + Markdown + PNG), logs it
to MLflow and links it from Dagster."""

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from dagster import AssetExecutionContext, Config, DataVersion, MaterializeResult, MetadataValue, asset

from ghostvis_core.data.eval_texts import PROMPTS
from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.ledger.summaries import held_out_text_shards
from ghostvis_core.data.tokenizer import load_tokenizer
from ghostvis_core.identity import code_version, digest
from ghostvis_core.plan.budget import DEFAULT_GPU_PRICES
from ghostvis_core.plan.selected import lineage as selected_lineage
from ghostvis_core.run.track.mlflow_records import add_files, add_to_run, metric_histories
from ghostvis_core.run.train.runs import run_result
from ghostvis_core.run.train.trained import load_stage, stage_config
from ghostvis_core.store import Store
from ghostvis_core.verify.eval.gate import tolerances
from ghostvis_core.verify.eval.harness_tasks import (
    CLOZE_FILE,
    CLOZE_TASK,
    DEFAULT_TASKS,
    cloze_jsonl,
    task_files_digest,
)
from ghostvis_core.verify.eval.report import stage_report, write_report
from ghostvis_pipeline.metadata import latest_metadata, md_table
from ghostvis_pipeline.resources import GhostvisHome

STAGES = selected_lineage().stage_names()  # the code location's lineage (definitions.py)


def lineage_run_keys(context) -> dict[str, str]:
    """The run key of each stage's newest materialization."""
    return {s: latest_metadata(context, s)["run_key"] for s in STAGES}


def eval_shards(store: Store, tokenizer_id: str, lineage: dict[str, str]) -> dict[str, list[dict]]:
    """The held-out plain-text shards every stage is scored on: the validation sources of the
    lineage's first stage (its data.val_sources, in that order) that have text validation shards
    in the ledger for the tokenizer; each shard's path is this machine's copy of its token file."""
    first = next(iter(lineage))
    sources = stage_config(store, run_result(store, first, lineage[first])).data.val_sources
    held_out = held_out_text_shards(Ledger.in_store(store), tokenizer_id, sources)
    return {
        source: [
            {**ref, "path": str(store.fetch("token_shard", tokenizer_id, ref["shard_id"], ref["content_sha256"]))}
            for ref in refs
        ]
        for source, refs in held_out.items()
    }


# The modules that make each eval asset (their code_version, ghostvis_core/identity.py).
EVALUATION_CODE = code_version(
    "ghostvis_core.verify.eval.benchmark", "ghostvis_core.run.train.trained", "ghostvis_core.verify.eval.harness"
)
REPORT_CODE = code_version("ghostvis_core.verify.eval.report", "ghostvis_core.run.track.mlflow_records")
MAX_BPB_TOKENS, MC_PER_TASK = 8192, 25


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
        "held_out": {s: [[x["shard_id"], content.get(x["shard_id"])] for x in shards] for s, shards in val.items()},
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
def evaluation(context: AssetExecutionContext, config: EvaluationConfig, home: GhostvisHome) -> MaterializeResult:
    """Validation bits per byte, a multiple-choice benchmark (lowest answer loss wins), sampled
    completions for fixed prompts and lm-evaluation-harness tasks, for every stage's newest
    checkpoint. A lineage scored before on the same held-out data and tasks is not scored again;
    data version: the identity of what was scored."""
    h = home.home()
    tolerance = tolerances(dict(config.bpb_tolerance))  # refused before scoring when it names no stage
    lineage = lineage_run_keys(context)
    tokenizer_id = latest_metadata(context, "tokenizer")["tokenizer_id"]
    val = eval_shards(h.store, tokenizer_id, lineage)
    key = digest(evaluation_identity(h.store, tokenizer_id, lineage, val, config))
    cached = h.store.exists("report", f"evaluation/{key}.json")
    if cached:
        context.log.info(f"evaluation: cache hit, lineage {', '.join(lineage.values())} was scored before ({key})")
        results = h.store.read_json("report", f"evaluation/{key}.json")
    else:
        held_out = held_out_folder(h, key, tokenizer_id, val, config.harness_tasks)
        harness = HarnessSetup(key, config.harness_tasks, config.harness_include, held_out)
        results = score_lineage(context, h, lineage, val, harness)
        h.store.write_text("report", f"evaluation/{key}.json", text=json.dumps(results, indent=2))
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
        "results": MetadataValue.path(h.store.uri_of("report", f"evaluation/{key}.json")),
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


@dataclass(frozen=True)
class HarnessSetup:
    """The harness run of one evaluation: its identity (where its output goes), tasks, the user's task
    folders and the folder of the held-out files GhostVis's cloze task reads."""

    key: str
    tasks: list[str]
    include: list[str]
    held_out_dir: Path | None


def held_out_folder(h, key: str, tokenizer_id: str, val: dict, tasks: list[str]) -> Path | None:
    """When the cloze task runs: its passages, cut from the held-out shards' text and saved with this
    evaluation's output (store: reports/evaluation/<key>/), and the folder holding them."""
    if CLOZE_TASK not in tasks:
        return None
    from ghostvis_core.verify.eval.benchmark import held_out_texts  # torch: only when an evaluation runs

    tok = load_tokenizer(tokenizer_id, h.store)
    texts = {source: held_out_texts(tok, refs) for source, refs in val.items()}
    name = f"evaluation/{key}/{CLOZE_FILE}"
    h.store.write_text("report", name, text=cloze_jsonl(texts))
    return h.store.fetch("report", name).parent  # a local copy where the store is remote


def score_lineage(context, h, lineage: dict[str, str], val: dict, harness: HarnessSetup) -> dict:
    """Every stage's scores. Stages are scored side by side, one per core, each op on the thread that
    calls it (benchmark.one_thread): no op waits for a thread that other load took the core from, and
    an idle host's cores are still all used. The harness and MLflow take one stage at a time (`serial`):
    lm-eval's task registry is the process's, and MLflow's database takes one writer."""
    from ghostvis_core.verify.eval.benchmark import one_thread

    serial = threading.Lock()
    workers = min(len(lineage), os.cpu_count() or 1)
    with one_thread(), ThreadPoolExecutor(workers, thread_name_prefix="score") as pool:
        scoring = {
            stage: pool.submit(score_stage, context, h, stage, run_key, val, harness, serial)
            for stage, run_key in lineage.items()
        }
        return {stage: future.result() for stage, future in scoring.items()}


def score_stage(context, h, stage: str, run_key: str, val: dict, harness: HarnessSetup, serial: threading.Lock) -> dict:
    """One stage's scores, also logged to its MLflow run; the harness's own output is saved in the
    store (reports/evaluation/<key>/harness/<stage>.json) and its metrics are read from it."""
    # torch, lm_eval and datasets (2 s) only when an evaluation runs, not in every process that loads the definitions
    from ghostvis_core.verify.eval.benchmark import bits_per_byte, build_items, multiple_choice, samples
    from ghostvis_core.verify.eval.harness import GhostvisLM, run_tasks

    t0 = time.time()
    ts = load_stage(h, stage, run_key)
    bpb = bits_per_byte(ts, val, max_tokens=MAX_BPB_TOKENS)
    mc = multiple_choice(ts, build_items(ts, val, per_task=MC_PER_TASK))
    smp = samples(ts)
    with serial:
        t1 = time.time()
        run = run_tasks(GhostvisLM(ts), harness.tasks, harness.include, harness.held_out_dir)
        saved = f"evaluation/{harness.key}/harness/{stage}.json"
        h.store.write_text("report", saved, text=json.dumps(run.results, indent=2))
        metrics = (
            {f"eval/bpb/{k}": v for k, v in bpb.items()}
            | {f"eval/mc/{k}": v for k, v in mc.items()}
            | {f"harness/{task}/{m}": v for task, ms in run.metrics.items() for m, v in ms.items()}
        )
        add_to_run(
            h.mlflow_tracking_uri,
            ts.result.mlflow_run_id,
            metrics,
            ts.result.steps,
            texts={"eval/samples.json": json.dumps(smp, indent=2)},
        )
        context.log.info(
            f"{stage}: bpb {bpb}, mc {mc['overall']:.2f}, harness {run.metrics} "
            f"({time.time() - t0:.1f}s, harness {time.time() - t1:.1f}s)"
        )
    return {"run_key": run_key, "bpb": bpb, "mc": mc, "samples": smp, "harness": run.metrics, "harness_results": saved}


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
    key = digest(
        {
            "lineage": lineage,
            "evaluation": evaluation_key,
            "gpu_prices": dict(config.gpu_prices),
            "bpb_tolerance": tolerance,
        }
    )
    name = list(lineage.values())[-1]
    done = store.read_json("identity", "report", name) if store.exists("identity", "report", name) else {}
    if done.get("digest") == key:
        context.log.info(f"report: cache hit, the card of {name} was written for the same inputs ({key})")
        return _report_result(store, name, done["metadata"], key, cached=True)
    evaluation_results = store.read_json("report", f"evaluation/{evaluation_key}.json")
    stages, smp = [], {}
    ledger = Ledger.in_store(store)
    for stage, run_key in lineage.items():
        result = run_result(store, stage, run_key)
        curves = metric_histories(tracking_uri, result.mlflow_run_id, ("train/loss", "val/loss"))
        ev = evaluation_results.get(stage, {})
        stages.append(
            stage_report(
                ledger, result, stage_config(store, result), curves, ev, dict(config.gpu_prices), tolerance[stage]
            )
        )
        smp[stage] = ev.get("samples", [])
    chain = selected_lineage()
    title = f"GhostVis report card, lineage {chain.name}: {' -> '.join(s.stage for s in stages)}"
    files = write_report(store, name, title, stages, smp)
    add_files(tracking_uri, stages[-1].mlflow_run_id, list(files.values()), "report")
    md = {
        "mlflow_run_id": stages[-1].mlflow_run_id,
        "stages": len(stages),
        "real_tokens_total": sum(s.totals["real_tokens"] for s in stages),
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

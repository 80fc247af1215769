"""The evaluation job's work: every stage of the lineage scored on the same held-out data (bits per byte,
the multiple-choice benchmark, sampled completions, lm-evaluation-harness tasks), each stage's scores
logged to its MLflow run and the harness's own output saved in the store. Runs in the job
(`python -m ghostvis_core.verify.eval`), never in the Dagster process: it loads every stage's model."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ghostvis_core.data.bpe_tokenizer import load_tokenizer
from ghostvis_core.run.track.mlflow_records import add_to_run
from ghostvis_core.run.trained_model import load_from_store
from ghostvis_core.store import Store
from ghostvis_core.verify.eval.benchmark import (
    bits_per_byte,
    build_items,
    held_out_texts,
    multiple_choice,
    one_thread,
    samples,
)
from ghostvis_core.verify.eval.eval_spec import EVAL_FOLDER, MAX_BPB_TOKENS, MC_PER_TASK, EvalSpec
from ghostvis_core.verify.eval.harness import GhostvisLM, run_tasks
from ghostvis_core.verify.eval.harness_tasks import CLOZE_FILE, CLOZE_TASK, cloze_jsonl


@dataclass(frozen=True)
class HarnessSetup:
    """The harness run of one evaluation: its identity (where its output goes), tasks, the user's task
    folders and the folder of the held-out files GhostVis's cloze task reads."""

    key: str
    tasks: list[str]
    include: list[str]
    held_out_dir: Path | None


def evaluate(spec: EvalSpec, store: Store, log: Callable[[str], None]) -> dict:
    """Every stage's scores (stage -> bpb, mc, samples, harness), on this machine's copies of the held-out shards."""
    val = {
        source: [
            {**ref, "path": str(store.fetch("token_shard", spec.tokenizer_id, ref["shard_id"], ref["content_sha256"]))}
            for ref in refs
        ]
        for source, refs in spec.held_out.items()
    }
    held_out = held_out_folder(store, spec, val)
    harness = HarnessSetup(spec.key, spec.harness_tasks, spec.harness_include, held_out)
    return score_lineage(store, spec, val, harness, log)


def held_out_folder(store: Store, spec: EvalSpec, val: dict) -> Path | None:
    """When the cloze task runs: its passages, cut from the held-out shards' text and saved with this
    evaluation's output (store: reports/evaluation/<key>/), and the folder holding them."""
    if CLOZE_TASK not in spec.harness_tasks:
        return None
    tok = load_tokenizer(spec.tokenizer_id, store)
    texts = {source: held_out_texts(tok, refs) for source, refs in val.items()}
    name = f"{EVAL_FOLDER}/{spec.key}/{CLOZE_FILE}"
    store.write_text("report", name, text=cloze_jsonl(texts))
    return store.fetch("report", name).parent  # a local copy where the store is remote


def score_lineage(store: Store, spec: EvalSpec, val: dict, harness: HarnessSetup, log: Callable[[str], None]) -> dict:
    """Every stage's scores. Stages are scored side by side, one per core, each op on the thread that
    calls it (benchmark.one_thread): no op waits for a thread that other load took the core from, and
    an idle host's cores are still all used. The harness and MLflow take one stage at a time (`serial`):
    lm-eval's task registry is the process's, and MLflow's database takes one writer."""
    serial = threading.Lock()
    workers = min(len(spec.lineage), os.cpu_count() or 1)
    with one_thread(), ThreadPoolExecutor(workers, thread_name_prefix="score") as pool:
        scoring = {
            stage: pool.submit(score_stage, store, spec, stage, val, harness, serial, log) for stage in spec.lineage
        }
        return {stage: future.result() for stage, future in scoring.items()}


def score_stage(
    store: Store,
    spec: EvalSpec,
    stage: str,
    val: dict,
    harness: HarnessSetup,
    serial: threading.Lock,
    log: Callable[[str], None],
) -> dict:
    """One stage's scores, also logged to its MLflow run; the harness's own output is saved in the
    store (reports/evaluation/<key>/harness/<stage>.json) and its metrics are read from it."""
    t0 = time.time()
    run_key = spec.lineage[stage]
    ts = load_from_store(store, stage, run_key)
    bpb = bits_per_byte(ts, val, max_tokens=MAX_BPB_TOKENS)
    mc = multiple_choice(ts, build_items(ts, val, per_task=MC_PER_TASK))
    smp = samples(ts)
    with serial:
        t1 = time.time()
        run = run_tasks(GhostvisLM(ts), harness.tasks, harness.include, harness.held_out_dir)
        saved = f"{EVAL_FOLDER}/{harness.key}/harness/{stage}.json"
        store.write_text("report", saved, text=json.dumps(run.results, indent=2))
        metrics = (
            {f"eval/bpb/{k}": v for k, v in bpb.items()}
            | {f"eval/mc/{k}": v for k, v in mc.items()}
            | {f"harness/{task}/{m}": v for task, ms in run.metrics.items() for m, v in ms.items()}
        )
        add_to_run(
            spec.mlflow_tracking_uri,
            ts.result.mlflow_run_id,
            metrics,
            ts.result.steps,
            texts={"eval/samples.json": json.dumps(smp, indent=2)},
        )
        log(
            f"{stage}: bpb {bpb}, mc {mc['overall']:.2f}, harness {run.metrics} "
            f"({time.time() - t0:.1f}s, harness {time.time() - t1:.1f}s)"
        )
    return {"run_key": run_key, "bpb": bpb, "mc": mc, "samples": smp, "harness": run.metrics, "harness_results": saved}

"""The end of a run: its RunResult (figures, evidence, mixture, frozen-parameter check), the last
MLflow metrics and the dataset inputs, and the run record in the store that tells every reader the
run is complete."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from ghostvis_core.data.ledger import Ledger
from ghostvis_core.plan.config import StageConfig
from ghostvis_core.run.model.gpt import attention_kernel
from ghostvis_core.run.model.vision import frozen_fingerprint
from ghostvis_core.run.track.shard_input import ShardInput
from ghostvis_core.run.train import checkpoint as ckpt
from ghostvis_core.run.train.result import BeforeAfter, FrozenCheck, MixtureShare, RunResult

if TYPE_CHECKING:  # the Trainer calls `report` at its end: the type only, no import cycle
    from ghostvis_core.run.train.trainer import Trainer


def report(run: Trainer) -> RunResult:
    """Rank 0 reports the run: mixture shares from the ledger, the last MLflow metrics and dataset
    inputs, the MLflow run ended, then the run record (what tells every reader the run is complete)."""
    result = run_result(run)
    if run.ctx.is_main:
        ledger = Ledger.in_store(run.store)
        result.mixture = mixture_shares(ledger, run.spec.run_key, run.cfg)
        run.tracker.metrics(final_metrics(result), step=result.steps)
        run.tracker.inputs(shard_inputs(run, {r["shard_id"] for r in ledger.consumed_by_shard(run.spec.run_key)}))
        result.mlflow_run_id = run.tracker.run_id()
        result.mlflow_experiment_id = run.tracker.mlflow.experiment_id
        result.mlflow_delivery = run.tracker.finish(
            {"ghostvis.checkpoint_uri": result.checkpoint_uri}, run.spec.run_key
        )
        run.store.write_json("run_record", run.spec.stage, run.spec.run_key, data=result.to_dict())
    return result


def shard_inputs(run: Trainer, consumed: set[str]) -> list[ShardInput]:
    """The train shards the run read (per the ledger) and every validation shard it evaluated on."""
    spec = run.spec
    refs = [r for shards in spec.train_shards.values() for r in shards if r.shard_id in consumed]
    refs += [r for shards in spec.val_shards.values() for r in shards]
    return [
        ShardInput(
            r.shard_id,
            r.source,
            r.split,
            r.content_sha256,
            run.store.uri_of("raw_shard", r.shard_id),
            run.store.uri_of("token_shard", spec.tokenizer_id, r.shard_id, r.content_sha256),
        )
        for r in refs
    ]


def run_result(run: Trainer) -> RunResult:
    s, p, spec = run.state, run.plan, run.spec
    return RunResult(
        run_key=spec.run_key,
        stage=spec.stage,
        steps=s.step,
        segment=s.segment,
        counts=s.counts,
        planned_tokens=spec.plan.planned_tokens,
        batch=p,
        train_loss=run.train_loss,
        val_loss=run.last_val.get("val/loss"),
        val_loss_start=s.val_start.get("val/loss"),
        tokens_per_sec=round(run.clock.tokens_per_sec(p.tokens_per_step), 1),
        first_step_s=round(run.clock.first_step_s or 0.0, 2),
        wall_time_s=round(time.time() - run.clock.launched, 1),
        checkpoint_uri=run.store.uri_of("checkpoint", spec.stage, spec.run_key, ckpt.step_dir_name(s.step)),
        parent_run_key=spec.parent_run_key,
        mlflow_run_id="",
        mlflow_experiment_id="",
        evidence=evidence(run),
        generated=dict(s.generated),
        frozen=FrozenCheck(run.frozen_before, frozen_fingerprint(run.model)) if run.frozen_before else None,
        **efficiency_fields(run),
    )


def efficiency_fields(run: Trainer) -> dict:
    """MFU over the run's throughput, FLOPs per token, the peak it is measured against, CUDA peak memory, the
    attention kernel."""
    e, tok_s = run.efficiency, run.clock.tokens_per_sec(run.plan.tokens_per_step)
    cuda = run.ctx.device.type == "cuda"
    return {
        "mfu": round(e.mfu(tok_s), 5),
        "flops_per_token": e.flops_per_token,
        "peak_flops": e.peak_flops,
        "peak_source": e.peak_source,
        "cuda_peak_memory_gb": round(torch.cuda.max_memory_allocated(run.ctx.device) / 1e9, 3) if cuda else None,
        "attention_kernel": attention_kernel(run.ctx.device, run.bf16),
    }


def evidence(run: Trainer) -> dict[str, BeforeAfter]:
    """Each `evidence/<name>` figure of the last evaluation, with its step-0 value when there is one."""
    before = run.state.val_start
    return {
        k.split("/", 1)[1]: BeforeAfter(before.get(k), v) for k, v in run.last_val.items() if k.startswith("evidence/")
    }


def mixture_shares(ledger: Ledger, run_key: str, cfg: StageConfig) -> dict[str, MixtureShare]:
    """Per recipe source: its fraction of the run's consumed shard tokens (from the ledger) and weight."""
    by_source: dict[str, int] = {}
    for r in ledger.consumed_by_shard(run_key):
        by_source[r["source"]] = by_source.get(r["source"], 0) + int(r["tokens"])
    total = sum(by_source.values()) or 1
    return {
        s.source: MixtureShare(by_source.get(s.source, 0) / total, s.weight, by_source.get(s.source, 0))
        for s in cfg.data.recipe
    }


def final_metrics(result: RunResult) -> dict[str, float]:
    """The MLflow metrics logged once at the end: mixture shares, frozen check, time to first step."""
    out: dict[str, float] = {}
    for source, m in result.mixture.items():
        out.update(
            {
                f"mixture/{source}/fraction": m.fraction,
                f"mixture/{source}/weight": m.weight,
                f"mixture/{source}/tokens": m.tokens,
            }
        )
    if result.frozen is not None:
        out["frozen_params_unchanged"] = int(result.frozen.unchanged)
    out["time/first_step_s"] = result.first_step_s
    return out

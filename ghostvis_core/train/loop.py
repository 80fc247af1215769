"""The training loop shared by every stage: DDP, grad accumulation, LR schedule, evaluation,
token accounting, checkpoints with their ledger parts, MLflow metrics and the Pipes report.

Loss normalisation: each step's loss is the mean over the loss tokens of the whole step (all
micro-batches, all ranks), so grad accumulation and world size change nothing but speed.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ghostvis_core.budget import BatchPlan, batch_plan
from ghostvis_core.config import StageConfig
from ghostvis_core.data.ledger import Ledger, pieces_to_rows
from ghostvis_core.data.loader import Consumption, merge_pieces
from ghostvis_core.errors import GhostvisError
from ghostvis_core.model.gpt import GPT
from ghostvis_core.model.vision import frozen_fingerprint
from ghostvis_core.track.mlflow_run import MlflowRun, MlflowTarget
from ghostvis_core.track.pipes import PipesReporter
from ghostvis_core.train import checkpoint as ckpt
from ghostvis_core.train.dist import DistContext, all_reduce_sum, barrier, gather_objects, print0
from ghostvis_core.train.objectives import build_objective
from ghostvis_core.train.spec import LaunchSpec

RUN_COMPLETE = "RUN_COMPLETE.json"


def lr_at(step: int, total: int, cfg: StageConfig) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio x lr at the last step."""
    o = cfg.optim
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    progress = (step - o.warmup_steps) / max(1, total - o.warmup_steps)
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def use_bf16(precision: str, device: torch.device) -> bool:
    if precision == "bf16":
        return True
    if precision == "fp32":
        return False
    if precision != "auto":
        raise GhostvisError(f"runtime.precision must be auto, bf16 or fp32, got '{precision}'")
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return cpu_has_bf16_matmul()


def cpu_has_bf16_matmul() -> bool:
    """AMX-BF16 or AVX512-BF16: oneDNN runs bf16 matmuls several times faster than fp32 there."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split("flags")[1].split("\n")[0].split()
    except (OSError, IndexError):
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def make_optimizer(model: torch.nn.Module, cfg: StageConfig, device) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                             fused=device.type == "cuda")


@dataclass
class Counters:
    """Token counters along the run's chain, summed over ranks (they travel in checkpoints)."""

    real_tokens: int = 0
    pad_tokens: int = 0
    loss_tokens: int = 0
    cropped_tokens: int = 0

    def add(self, values: list[int]) -> None:
        self.real_tokens += values[0]
        self.pad_tokens += values[1]
        self.loss_tokens += values[2]
        self.cropped_tokens += values[3]

    def as_dict(self) -> dict[str, int]:
        return dict(real_tokens=self.real_tokens, pad_tokens=self.pad_tokens,
                    loss_tokens=self.loss_tokens, cropped_tokens=self.cropped_tokens)


def train(spec: LaunchSpec, ctx: DistContext) -> dict[str, Any]:
    t_launch = time.time()
    cfg = StageConfig.from_dict(spec.config)
    plan = _batch_plan(cfg, ctx)
    total_steps = int(spec.plan["steps"])
    run_dir = Path(spec.checkpoint_dir)
    torch.manual_seed(cfg.data.seed)

    model = GPT(cfg.model)
    if cfg.vision is not None:
        model.attach_vision(cfg.vision)
    model.to(ctx.device)
    model.grad_checkpointing = cfg.runtime.grad_checkpointing
    resume = ckpt.latest_complete(run_dir)
    state: dict[str, Any] = {}
    if resume is not None:
        ckpt.load_model(resume.path, model)
        state = ckpt.read_json(resume.path, "trainer.json")
        _publish_parts(run_dir, Path(spec.ledger_dir))
    elif spec.init_checkpoint:
        # The stage that introduces the vision stack starts it fresh; everything else must match.
        ckpt.load_model(Path(spec.init_checkpoint), model,
                        allow_missing=("vision.",) if spec.extra.get("new_vision") else ())
    objective = build_objective(spec, cfg)
    objective.prepare_model(model)
    frozen_before = frozen_fingerprint(model) if any(not p.requires_grad for p in model.parameters()) else None
    optimizer = make_optimizer(model, cfg, ctx.device)
    if resume is not None:
        ckpt.load_optimizer(resume.path, model, optimizer)
        ckpt.load_rng(resume.path)
    ddp = DDP(model) if ctx.world_size > 1 else model
    bf16 = use_bf16(cfg.runtime.precision, ctx.device)

    def autocast():
        return torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=bf16)

    if state and state.get("tokens_per_step", plan.tokens_per_step) != plan.tokens_per_step:
        raise GhostvisError(
            f"run {spec.run_key}: the checkpoint was trained with tokens_per_step={state['tokens_per_step']} "
            f"but this launch has {plan.tokens_per_step}; resume with the same micro_batch_size x seq_len x "
            "world_size x grad_accum_steps product (e.g. halve grad_accum_steps when doubling the world size)"
        )
    step = int(state.get("step", 0))
    rows = int(state.get("rows_consumed", 0))
    segment = int(state.get("segment", -1)) + 1
    head_part = state.get("head_part_id")
    counters = Counters(**state.get("counters", {}))
    history: dict[str, Any] = state.get("history", {})

    tracker = pipes = None
    if ctx.is_main:
        tracker = MlflowRun(
            MlflowTarget(spec.mlflow_tracking_uri, spec.mlflow_experiment, spec.mlflow_artifact_location,
                         run_name=spec.run_key, run_id=state.get("mlflow_run_id"),
                         tags={**spec.tags, "ghostvis.segment": str(segment)}),
            params={**cfg.to_dict(), "plan": spec.plan, "run_key": spec.run_key},
        )
        pipes = PipesReporter(True)
    print0(f"[{spec.stage}] run {spec.run_key} segment {segment}: "
           f"{'resume from step ' + str(step) if resume else 'start'}; tokens_per_step={plan.tokens_per_step} "
           f"({plan.micro_batch_size} x {plan.seq_len} x world {plan.world_size} x accum {plan.grad_accum_steps}), "
           f"{total_steps} steps, bf16={bf16}", ctx=ctx)

    if step == 0:
        history["val_start"] = objective.evaluate(model, ctx, autocast, evidence=True)
        if tracker:
            tracker.log_metrics(history["val_start"], step=0)
    consumption = Consumption()
    part_first_step, part_first_rows = step, rows
    t_first_step = None
    t_loop = time.time()
    steps_timed = 0
    train_loss = float("nan")
    last_val: dict[str, float] = dict(history.get("val_last", history.get("val_start", {})))

    while step < total_steps:
        t0 = time.time()
        lr = lr_at(step, total_steps, cfg)
        for g in optimizer.param_groups:
            g["lr"] = lr
        batches = objective.step_batches(rows, plan, ctx.rank)
        (n_loss,) = all_reduce_sum([sum(b.units for b in batches)], ctx, dtype=torch.int64)
        loss_total = 0.0
        for m, b in enumerate(batches):
            sync = contextlib.nullcontext() if (m == len(batches) - 1 or ctx.world_size == 1) else ddp.no_sync()
            with sync:
                with autocast():
                    loss_sum = objective.loss_sum(ddp, b, ctx.device)
                (loss_sum * (ctx.world_size / max(1, n_loss))).backward()
            loss_total += float(loss_sum.detach())
            consumption.add(b)
        if cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        rows += plan.rows_per_step
        reduced = all_reduce_sum([loss_total, *[sum(getattr(b, k) for b in batches) for k in
                                  ("real_tokens", "pad_tokens", "loss_tokens", "cropped_tokens")]], ctx)
        train_loss = reduced[0] / max(1, n_loss)
        counters.add([int(v) for v in reduced[1:]])
        now = time.time()
        if t_first_step is None:
            t_first_step = now - t_launch
            t_loop = now  # throughput excludes the first step (allocator and thread warm-up)
        else:
            steps_timed += 1
        tok_per_s = steps_timed * plan.tokens_per_step / max(1e-9, now - t_loop) if steps_timed else 0.0

        metrics: dict[str, float] = {}
        if step % cfg.runtime.log_every_steps == 0 or step == total_steps or step == 1:
            eta = (total_steps - step) * (now - t_loop) / max(1, steps_timed)
            metrics.update({"train/loss": train_loss, "lr": lr, "throughput/tokens_per_sec": tok_per_s,
                            "tokens/real": counters.real_tokens, "tokens/pad": counters.pad_tokens,
                            "tokens/loss": counters.loss_tokens, "tokens/cropped": counters.cropped_tokens,
                            "time/step_s": now - t0})
            msg = (f"[{spec.stage}] step {step}/{total_steps} loss {train_loss:.4f} lr {lr:.2e} "
                   f"{tok_per_s:,.0f} tok/s eta {eta:,.0f}s tokens/real {counters.real_tokens:,}")
            print0(msg, ctx=ctx)
            if pipes:
                pipes.log(msg)
        if step % cfg.eval.every_steps == 0 or step == total_steps:
            last_val = objective.evaluate(model, ctx, autocast, evidence=step == total_steps)
            metrics.update(last_val)
            print0(f"[{spec.stage}] step {step} val/loss {last_val.get('val/loss', float('nan')):.4f}", ctx=ctx)
        if tracker and metrics:
            tracker.log_metrics(metrics, step=step)
        if step % cfg.checkpoint.every_steps == 0 or step == total_steps:
            history["val_last"] = last_val
            head_part = _checkpoint(
                spec, cfg, ctx, plan, model, optimizer, objective, consumption, tracker,
                step=step, rows=rows, segment=segment, prev_part=head_part, counters=counters,
                part_first=(part_first_step, part_first_rows), history=history,
            )
            consumption = Consumption()
            part_first_step, part_first_rows = step, rows

    result = {
        "run_key": spec.run_key, "stage": spec.stage, "steps": step, "segment": segment,
        **counters.as_dict(),
        "planned_tokens": int(spec.plan["planned_tokens"]), "tokens_per_step": plan.tokens_per_step,
        "micro_batch_size": plan.micro_batch_size, "seq_len": plan.seq_len, "world_size": plan.world_size,
        "grad_accum_steps": plan.grad_accum_steps,
        "train_loss": train_loss, "val_loss": last_val.get("val/loss"),
        "val_loss_start": history.get("val_start", {}).get("val/loss"),
        "tokens_per_sec": round(tok_per_s, 1), "first_step_s": round(t_first_step or 0.0, 2),
        "wall_time_s": round(time.time() - t_launch, 1),
        "checkpoint_uri": str(run_dir / ckpt.step_dir_name(step)),
        "parent_run_key": spec.parent_run_key,
    }
    before = history.get("val_start", {})
    for k, v in last_val.items():
        if k.startswith("evidence/"):
            name = k.split("/", 1)[1]
            result[f"{name}_after"] = v
            if k in before:
                result[f"{name}_before"] = before[k]
    if frozen_before is not None:
        frozen_after = frozen_fingerprint(model)
        result["frozen_params_sha256_before"] = frozen_before
        result["frozen_params_sha256_after"] = frozen_after
        result["frozen_params_unchanged"] = int(frozen_before == frozen_after)
    if ctx.is_main:
        result.update(mixture_fractions(Ledger(Path(spec.ledger_dir)), spec.run_key, cfg))
        tracker.log_metrics({k: v for k, v in result.items() if k.startswith(("mixture/", "frozen_params_unchanged"))},
                            step=step)
        result["mlflow_run_id"] = tracker.wait_run_id()
        result["mlflow_experiment_id"] = tracker.experiment_id
        tracker.set_tags({"ghostvis.checkpoint_uri": result["checkpoint_uri"]})
        tracker.log_metrics({"time/first_step_s": result["first_step_s"]}, step=step)
        result.update({f"mlflow_{k}": v for k, v in tracker.finish("FINISHED").items()})
        (run_dir / RUN_COMPLETE).write_text(json.dumps(result, indent=2, sort_keys=True))
        pipes.report_materialization({k: v for k, v in result.items() if v is not None})
        pipes.close()
    return result


def mixture_fractions(ledger: Ledger, run_key: str, cfg: StageConfig) -> dict[str, float]:
    """Per source: the fraction of the run's consumed shard tokens (from the ledger) and the
    recipe weight it should match."""
    by_source: dict[str, int] = {}
    for r in ledger.consumed_by_shard(run_key):
        by_source[r["source"]] = by_source.get(r["source"], 0) + int(r["tokens"])
    total = sum(by_source.values()) or 1
    out = {}
    for s in cfg.data.recipe:
        out[f"mixture/{s.source}/fraction"] = by_source.get(s.source, 0) / total
        out[f"mixture/{s.source}/weight"] = s.weight
        out[f"mixture/{s.source}/tokens"] = by_source.get(s.source, 0)
    return out


def _batch_plan(cfg: StageConfig, ctx: DistContext) -> BatchPlan:
    if cfg.batch.total_batch_tokens is None and cfg.batch.world_size != ctx.world_size:
        raise GhostvisError(
            f"config batch.world_size={cfg.batch.world_size} but {ctx.world_size} ranks were started; "
            f"set batch.world_size={ctx.world_size} (or set batch.total_batch_tokens to derive grad_accum)"
        )
    return batch_plan(cfg.batch, ctx.world_size)


def _checkpoint(spec, cfg, ctx, plan, model, optimizer, objective, consumption, tracker, *,
                step, rows, segment, prev_part, counters, part_first, history) -> str:
    """Gather this part's consumption to rank 0, write checkpoint + ledger part in one commit."""
    gathered = gather_objects((consumption.pieces, consumption.counters()), ctx)
    part_id = f"{spec.run_key}.s{segment:03d}.p{step:09d}"
    if ctx.is_main:
        pieces = [p for ps, _ in gathered for p in ps]
        part_counts = [sum(c[i] for _, c in gathered) for i in range(4)]
        merged, overlap = merge_pieces(pieces)
        run_dir = Path(spec.checkpoint_dir)
        staging = run_dir / f".ledger-{part_id}"
        Ledger(staging).write_part(
            {
                "part_id": part_id, "prev_part_id": prev_part or "", "run_key": spec.run_key,
                "parent_run_key": spec.parent_run_key or "", "stage": spec.stage, "segment": segment,
                "step_first": part_first[0] + 1, "step_last": step,
                "rows_first": part_first[1], "rows_last": rows,
                "real_tokens": part_counts[0], "pad_tokens": part_counts[1],
                "loss_tokens": part_counts[2], "cropped_tokens": part_counts[3], "overlap_tokens": overlap,
                "micro_batch_size": plan.micro_batch_size, "seq_len": plan.seq_len,
                "world_size": plan.world_size, "grad_accum_steps": plan.grad_accum_steps,
                "tokens_per_step": plan.tokens_per_step, "planned_tokens": int(spec.plan["planned_tokens"]),
                "allow_repeat": cfg.data.allow_repeat, "replay_sources": json.dumps(cfg.data.replay_sources),
                "mlflow_run_id": tracker.wait_run_id(),
            },
            pieces_to_rows(merged, objective.rows_of),
        )
        trainer_state = {
            "step": step, "rows_consumed": rows, "segment": segment, "head_part_id": part_id,
            "tokens_per_step": plan.tokens_per_step, "world_size": plan.world_size,
            "counters": counters.as_dict(), "mlflow_run_id": tracker.run_id, "run_key": spec.run_key,
            "history": history,
        }
        path = ckpt.save(run_dir, step, model=model, optimizer=optimizer, trainer_state=trainer_state,
                         config=spec.config, keep_last=cfg.checkpoint.keep_last, extra_dirs={"ledger": staging})
        _publish_parts(run_dir, Path(spec.ledger_dir), only=path)
    barrier(ctx)
    return part_id


def _publish_parts(run_dir: Path, ledger_dir: Path, only: Path | None = None) -> None:
    """Copy committed checkpoints' ledger parts into the ledger (idempotent: same names)."""
    refs = [only] if only else [r.path for r in ckpt.list_complete(run_dir)]
    for path in refs:
        for f in (path / "ledger").rglob("*.parquet"):
            dest = ledger_dir / f.relative_to(path / "ledger")
            if not dest.exists():
                dest.parent.mkdir(parents=True, exist_ok=True)
                tmp = dest.with_name(f".{dest.name}.tmp")
                shutil.copyfile(f, tmp)
                tmp.replace(dest)

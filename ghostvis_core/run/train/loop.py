"""The training loop shared by every stage, in short steps: `setup` builds a `Run`, then
`train_step`, `maybe_eval` and `maybe_checkpoint` repeat until the budget's last step, and `finish`
writes the RunResult.

Loss normalisation: each step's loss is the mean over the loss units of the whole step (all
micro-batches, all ranks), so grad accumulation and world size change nothing but speed.
"""

from __future__ import annotations

import math
import time

import torch

from ghostvis_core.plan.config import StageConfig
from ghostvis_core.counts import ROLLOUT_METRICS, TokenCounts
from ghostvis_core.data.loader import Consumption
from ghostvis_core.run.train.commit import commit
from ghostvis_core.run.train.dist import DistContext, all_reduce_sum
from ghostvis_core.run.train.feeds import FedLog
from ghostvis_core.run.train.finish import finish
from ghostvis_core.run.train.grpo import RolloutLog, count_step
from ghostvis_core.run.train.result import RunResult
from ghostvis_core.run.train.run import Run
from ghostvis_core.run.train.setup import setup
from ghostvis_core.run.train.spec import LaunchSpec


def train(spec: LaunchSpec, ctx: DistContext) -> RunResult:
    """Train a stage to its last step (resuming where its newest checkpoint left off)."""
    run = setup(spec, ctx)
    begin(run)
    while run.state.step < run.total_steps:
        train_step(run)
        metrics = progress(run)
        metrics.update(maybe_eval(run))
        run.tracker.metrics(metrics, step=run.state.step)
        maybe_checkpoint(run)
    return finish(run)


def begin(run: Run) -> None:
    s, p = run.state, run.plan
    run.tracker.say(
        f"[{run.spec.stage}] run {run.spec.run_key} segment {s.segment}: "
        f"{'resume from step ' + str(s.step) if run.resumed else 'start'}; tokens_per_step={p.tokens_per_step} "
        f"({p.micro_batch_size} x {p.seq_len} x world {p.world_size} x accum {p.grad_accum_steps}), "
        f"{run.total_steps} steps, bf16={run.bf16}")
    if s.step == 0:
        with run.parallel.evaluating():
            s.history["val_start"] = run.objective.evaluate(run.model, run.ctx, run.autocast, evidence=True)
        run.tracker.metrics(s.history["val_start"], step=0)
    else:  # the interrupted segment's last points may not have reached MLflow before it died: the
        # committed step it resumes from gets its token point again (`mlflow_token_history` reads it)
        run.tracker.metrics(token_metrics(run), step=s.step)
    run.last_val = dict(s.history.get("val_last", s.history.get("val_start", {})))
    run.part_first = (s.step, s.rows)


def train_step(run: Run) -> None:
    """One optimizer step over the step's micro-batches; the counts are summed over ranks."""
    s, ctx = run.state, run.ctx
    started = time.time()
    lr = lr_at(s.step, run.total_steps, run.cfg)
    for g in run.optimizer.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)  # Muon's group: muon_lr on the same schedule
    batches = run.objective.step_batches(s.rows, run.plan, ctx.rank)
    (n_units,) = all_reduce_sum([sum(b.units for b in batches)], ctx, dtype=torch.int64)
    loss_total = 0.0
    for m, b in enumerate(batches):
        run.fed.add(s.step + 1, b)
        run.rollouts.add(s.step + 1, b)
        with run.parallel.accumulating(last_micro_step=m == len(batches) - 1):
            with run.autocast():
                loss_sum = run.objective.loss_sum(run.parallel.forward_module, b, ctx.device)
            (loss_sum * (ctx.world_size / max(1, n_units))).backward()
        loss_total += float(loss_sum.detach())
        run.consumption.add(b)
    if run.cfg.optim.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), run.cfg.optim.grad_clip)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    step_counts = TokenCounts.total(b.counts for b in batches)
    reduced = all_reduce_sum([loss_total, *step_counts.as_list()], ctx)
    run.train_loss = reduced[0] / max(1, n_units)
    s.counts = s.counts + TokenCounts.from_list(reduced[1:])
    s.generated, run.step_reward = count_step(run.rollouts, s.step + 1, s.generated, ctx)
    s.step += 1
    s.rows += run.plan.rows_per_step
    run.clock.tick(started)


def progress(run: Run) -> dict[str, float]:
    """Every log_every_steps (and at the first and last step): a progress line and its metrics. At every
    checkpoint step at least the token figures, so each committed ledger part has its MLflow point to
    be checked against (`mlflow_token_history`)."""
    s = run.state
    if not (s.step % run.cfg.runtime.log_every_steps == 0 or s.step in (1, run.total_steps)):
        return token_metrics(run) if s.step % run.cfg.checkpoint.every_steps == 0 else {}
    tok_s = run.clock.tokens_per_sec(run.plan.tokens_per_step)
    lr = run.optimizer.param_groups[0]["lr"]
    run.tracker.say(f"[{run.spec.stage}] step {s.step}/{run.total_steps} loss {run.train_loss:.4f} lr {lr:.2e} "
                    f"{tok_s:,.0f} tok/s MFU {run.efficiency.mfu(tok_s):.1%} eta {run.clock.eta_s(run.total_steps - s.step):,.0f}s "
                    f"tokens/real {s.counts.real_tokens:,}", pipes=True)
    return {"train/loss": run.train_loss, "lr": lr, "throughput/tokens_per_sec": tok_s,
            **token_metrics(run), "time/step_s": run.clock.last_step_s,
            **run.efficiency.metrics(tok_s, run.ctx.device)}


def token_metrics(run: Run) -> dict[str, float]:
    """The token figures' running totals; for a stage that samples (rl) also the rollout figures and the
    step's mean reward (none yet right after a resume)."""
    s = run.state
    out: dict[str, float] = {**s.counts.as_metrics(), **{ROLLOUT_METRICS[k]: v for k, v in s.generated.items()}}
    if s.generated and not math.isnan(run.step_reward):
        out["rl/reward_mean"] = run.step_reward
    return out


def maybe_eval(run: Run) -> dict[str, float]:
    """Held-out evaluation every eval.every_steps and at the end (with the stage's evidence)."""
    s = run.state
    if not (s.step % run.cfg.eval.every_steps == 0 or s.step == run.total_steps):
        return {}
    with run.parallel.evaluating():
        run.last_val = run.objective.evaluate(run.model, run.ctx, run.autocast, evidence=s.step == run.total_steps)
    run.tracker.say(f"[{run.spec.stage}] step {s.step} val/loss {run.last_val.get('val/loss', float('nan')):.4f}")
    return run.last_val


def maybe_checkpoint(run: Run) -> None:
    """Every checkpoint.every_steps and at the end: checkpoint + ledger part, committed together."""
    s = run.state
    if s.step % run.cfg.checkpoint.every_steps == 0 or s.step == run.total_steps:
        s.history["val_last"] = run.last_val
        commit(run)
        run.consumption, run.fed, run.rollouts = Consumption(), FedLog(), RolloutLog()
        run.part_first = (s.step, s.rows)


def lr_at(step: int, total: int, cfg: StageConfig) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio x lr at the last step."""
    o = cfg.optim
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    progress_ = (step - o.warmup_steps) / max(1, total - o.warmup_steps)
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress_))))

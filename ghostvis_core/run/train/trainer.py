"""Trainer: one stage run while it trains. It owns everything the run holds (spec, config, batch plan,
model behind its parallel wrapper, optimizer, objective, tracker, checkpoints, the TrainState and the
clock); its methods are the steps `loop.train` calls, and nothing outside changes its fields.

Loss normalisation: each step's loss is the mean over the loss units of the whole step (all
micro-batches, all ranks), so grad accumulation and world size change nothing but speed.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field

import torch

from ghostvis_core.counts import ROLLOUT_METRICS, TokenCounts
from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.ledger.records import PartRow
from ghostvis_core.data.loader import Batch
from ghostvis_core.plan.batch import BatchPlan
from ghostvis_core.plan.config import StageConfig
from ghostvis_core.run.model.gpt import attention_kernel
from ghostvis_core.run.model.vision import frozen_fingerprint
from ghostvis_core.run.track.shard_input import ShardInput
from ghostvis_core.run.train.checkpoint_manager import CheckpointManager, PartLog
from ghostvis_core.run.train.clock import Clock
from ghostvis_core.run.train.dist import DistContext, on_device, summed_on_device
from ghostvis_core.run.train.efficiency import Efficiency
from ghostvis_core.run.train.grpo import count_step
from ghostvis_core.run.train.live_metrics import Tracker
from ghostvis_core.run.train.objectives import Objective
from ghostvis_core.run.train.parallel import SingleProcess
from ghostvis_core.run.train.preemption import Preempted, PreemptionFlag
from ghostvis_core.run.train.state import TrainState
from ghostvis_core.run.train.timeline import Timeline
from ghostvis_core.run.train.watchdog import Watchdog
from ghostvis_core.runs.launch_spec import LaunchSpec
from ghostvis_core.runs.run_result import BeforeAfter, FrozenCheck, MixtureShare, RunResult
from ghostvis_core.store import Store
from ghostvis_core.store.fence import LeaseLost
from ghostvis_core.store.layout import step_dir_name


@dataclass(eq=False)
class Trainer:
    """Built by `setup.setup` (the order of building is part of exact resume); trains with its steps."""

    spec: LaunchSpec
    cfg: StageConfig
    ctx: DistContext
    plan: BatchPlan
    store: Store
    parallel: SingleProcess  # or a Replicated / Sharded subclass
    optimizer: torch.optim.Optimizer
    objective: Objective
    bf16: bool
    tracker: Tracker
    checkpoints: CheckpointManager
    state: TrainState
    clock: Clock
    resumed: bool
    frozen_before: str | None
    efficiency: Efficiency
    preemption: PreemptionFlag
    watchdog: Watchdog
    timeline: Timeline  # rank 0's record of where this launch's time went (train/timeline.py)
    part: PartLog = field(init=False)  # what this rank delivered since the last checkpoint
    train_loss: float = field(init=False, default=float("nan"))
    step_rewards: dict[str, float] = field(init=False, default_factory=dict)  # rl: the last step's, all ranks
    last_val: dict[str, float] = field(init=False, default_factory=dict)  # the newest held-out evaluation
    saved_at: float = field(init=False, default_factory=time.time)  # rank 0: when the last checkpoint was committed
    committed_step: int = field(init=False)  # the newest committed step: resumed from, or committed here
    stop_flags: tuple[bool, bool, bool] = field(init=False, default=(False, False, False))  # agreed at the step's end

    def __post_init__(self) -> None:
        self.part = self._new_part()
        self.committed_step = self.state.step

    @property
    def total_steps(self) -> int:
        return self.spec.plan.steps

    @property
    def model(self) -> torch.nn.Module:
        return self.parallel.model

    def autocast(self):
        return torch.autocast(self.ctx.device.type, dtype=torch.bfloat16, enabled=self.bf16)

    def begin(self) -> None:
        """The run's first line; at step 0 the evaluation before training, on a resume the token points of
        every committed step again, from the ledger (an interrupted segment's last points may have died in
        its MLflow buffer; `mlflow_token_history` reads them, and a point logged twice is one value). The MLflow
        run is started first (`Tracker.start_mlflow`): its Python runs beside the evaluation, before the first
        step, not inside the steps whose throughput is measured."""
        s, p = self.state, self.plan
        self.tracker.start_mlflow()
        self.tracker.say(
            f"[{self.spec.stage}] run {self.spec.run_key} segment {s.segment}: "
            f"{'resume from step ' + str(s.step) if self.resumed else 'start'}; tokens_per_step={p.tokens_per_step} "
            f"({p.micro_batch_size} x {p.seq_len} x world {p.world_size} x accum {p.grad_accum_steps}), "
            f"{self.total_steps} steps, bf16={self.bf16}"
        )
        if s.step == 0:
            with self.parallel.evaluating(), self.timeline.phase("eval"):
                s.val_start = self.objective.evaluate(self.model, self.ctx, self.autocast, evidence=True)
            self.tracker.metrics(s.val_start, step=0)
        else:
            for step, counts in self.checkpoints.committed_counts():
                self.tracker.metrics(counts.as_metrics(), step=step)
            self.tracker.metrics(self.token_metrics(), step=s.step)
        self.last_val = dict(s.val_last or s.val_start)
        self.watchdog.start(s.step)

    def train_step(self) -> None:
        """One optimizer step over the step's micro-batches: forward, backward, clip, step, as in a plain
        PyTorch loop. The accounting is one call per micro-batch (`PartLog.feed`: what the model is fed) and one
        per step (`account_step`). The host waits for the device once, at the step's end: the loss units'
        all-reduce stays on the device (it scales every micro-batch's loss) and the loss sums add up there."""
        s, ctx = self.state, self.ctx
        started = time.time()
        lr = lr_at(s.step, self.total_steps, self.cfg)
        for g in self.optimizer.param_groups:
            g["lr"] = lr * g.get("lr_scale", 1.0)  # Muon's group: muon_lr on the same schedule
        batches = self.objective.step_batches(s.loader.rows, self.plan, ctx.rank)
        with self.watchdog.waiting_in(f"the all-reduce of step {s.step + 1}'s loss units"):
            n_units = summed_on_device(on_device([sum(b.units for b in batches)], ctx, torch.int64), ctx)
        scale = ctx.world_size / n_units.clamp_min(1).double()
        loss_total = torch.zeros((), dtype=torch.float64, device=ctx.device)
        for m, b in enumerate(batches):
            self.part.feed(s.step + 1, b)
            with self.parallel.accumulating(last_micro_step=m == len(batches) - 1):
                with self.autocast():
                    loss_sum = self.objective.loss_sum(self.parallel.forward_module, b, ctx.device)
                with self.watchdog.waiting_in(
                    f"step {s.step + 1} micro-batch {m + 1}'s backward (gradient all-reduce)"
                ):
                    (loss_sum * scale.to(loss_sum.dtype)).backward()
            loss_total += loss_sum.detach()
        if self.cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.account_step(batches, loss_total, n_units, started)

    def account_step(
        self, batches: list[Batch], loss_total: torch.Tensor, n_units: torch.Tensor, started: float
    ) -> None:
        """The step's accounting once its optimizer step is queued: its figures summed over ranks in the step's
        one host read (`step_figures`, with the stop flags, which the ranks so agree on at every step boundary:
        train/preemption.py), the run's token counts, the content digests (`FedLog.settle`, after that read), an
        rl step's rollout figures, the state's step and loader position, the clock and the watchdog."""
        s, ctx = self.state, self.ctx
        step_counts = TokenCounts.total(b.counts for b in batches)
        with self.watchdog.waiting_in(f"the all-reduce of step {s.step + 1}'s token counts"):
            reduced, units, self.stop_flags = self.step_figures(loss_total, step_counts, n_units)
        self.train_loss = reduced[0] / max(1, units)
        s.counts = s.counts + TokenCounts.from_list(reduced[1:])
        self.part.fed.settle()
        s.generated, self.step_rewards = count_step(
            self.part.rollouts, s.step + 1, s.generated, self.cfg.grpo, ctx, batches
        )
        s.step += 1
        s.loader.advance(self.plan.rows_per_step)
        self.clock.tick(started)
        self.watchdog.progress(s.step)

    def step_figures(
        self, loss_total: torch.Tensor, counts: TokenCounts, n_units: torch.Tensor
    ) -> tuple[list[float], int, tuple[bool, bool, bool]]:
        """The step's one host read: its loss sum and token counts summed over ranks, with this rank's stop
        flags (told to stop; on rank 0 checkpoint.every_minutes passed, and its lease lost) in the same
        all-reduce, and the loss units reduced at the step's start. Returns ([loss, *counts], units, (a rank was
        signalled, minutes due, rank 0's lease lost)), the same on every rank."""
        minutes = self.cfg.checkpoint.every_minutes
        due = self.ctx.is_main and minutes > 0 and time.time() - self.saved_at >= minutes * 60
        flags = [self.preemption.raised, int(due), self.preemption.lease_lost]
        host = on_device([*counts.as_list(), *flags], self.ctx)
        summed = summed_on_device(torch.cat([loss_total.reshape(1), host]), self.ctx)
        *reduced, signalled, timed, lost, units = torch.cat([summed, n_units.double().reshape(1)]).tolist()
        return reduced, int(units), (signalled > 0, timed > 0, lost > 0)

    def stop_preempted(self) -> None:
        """Commit the last whole step (unless it is committed: the resumed checkpoint's step, or 0) and an async
        save still in flight, then, bounded by what is left of the grace period, MLflow's last points; stop
        (`Preempted`), naming the newest step the store holds."""
        s = self.state
        if s.step != self.committed_step:
            self.commit()
        with self.watchdog.in_phase(f"the checkpoint save in flight at step {s.step}"):
            committed = self.checkpoints.settle_all()
        self.tracker.suspend(timeout_s=self.preemption.grace_left() / 2)  # the other half: the lease, the exit
        raise Preempted(s.step, self.preemption.signal_name or "a signal to another rank", committed)

    def progress(self) -> dict[str, float]:
        """Every log_every_steps (and at the first and last step): a progress line and its metrics. At every
        checkpoint step at least the token figures, so each committed ledger part has its MLflow point to
        be checked against (`mlflow_token_history`)."""
        s = self.state
        if not (s.step % self.cfg.runtime.log_every_steps == 0 or s.step in (1, self.total_steps)):
            return self.token_metrics() if s.step % self.cfg.checkpoint.every_steps == 0 else {}
        tok_s = self.clock.tokens_per_sec(self.plan.tokens_per_step)
        lr = self.optimizer.param_groups[0]["lr"]
        eta = self.clock.eta_s(self.total_steps - s.step)
        self.tracker.say(
            f"[{self.spec.stage}] step {s.step}/{self.total_steps} loss {self.train_loss:.4f} lr {lr:.2e} "
            f"{tok_s:,.0f} tok/s MFU {self.efficiency.mfu(tok_s):.1%} eta {eta:,.0f}s "
            f"tokens/real {s.counts.real_tokens:,}",
            pipes=True,
        )
        return {
            "train/loss": self.train_loss,
            "lr": lr,
            "throughput/tokens_per_sec": tok_s,
            **self.token_metrics(),
            "time/step_s": self.clock.last_step_s,
            **self.efficiency.metrics(tok_s, self.ctx.device),
        }

    def token_metrics(self) -> dict[str, float]:
        """The token figures' running totals; for a stage that samples (rl) also the rollout figures and the
        step's sampled-reward figures (grpo.count_step; none yet right after a resume)."""
        s = self.state
        out: dict[str, float] = {**s.counts.as_metrics(), **{ROLLOUT_METRICS[k]: v for k, v in s.generated.items()}}
        return out | (self.step_rewards if s.generated else {})

    def evaluate(self) -> dict[str, float]:
        """Held-out evaluation every eval.every_steps and at the end (with the stage's evidence)."""
        s = self.state
        if not (s.step % self.cfg.eval.every_steps == 0 or s.step == self.total_steps):
            return {}
        with (
            self.parallel.evaluating(),
            self.watchdog.in_phase(f"the evaluation after step {s.step}"),
            self.timeline.phase("eval"),
        ):
            self.last_val = self.objective.evaluate(
                self.model, self.ctx, self.autocast, evidence=s.step == self.total_steps
            )
        val_loss = self.last_val.get("val/loss", float("nan"))
        self.tracker.say(f"[{self.spec.stage}] step {s.step} val/loss {val_loss:.4f}")
        return self.last_val

    def log(self, metrics: dict[str, float]) -> None:
        """The step's metrics to MLflow (the run started in `begin`)."""
        self.tracker.metrics(metrics, step=self.state.step)

    def checkpoint(self) -> None:
        """Every checkpoint.every_steps, every checkpoint.every_minutes, at the end, and when any rank was told
        to stop (preemption): the checkpoint and its ledger part, committed together (`CheckpointManager.commit`);
        the next part starts here. Whether the clock or a signal asks for one was agreed by all ranks in the
        step's own all-reduce (`step_figures`), so they all commit at the same step; a preempted run then stops
        (`Preempted`)."""
        s = self.state
        preempted, minutes_due, lease_lost = self.stop_flags
        if lease_lost:
            raise self.lease_lost()
        if not (
            s.step % self.cfg.checkpoint.every_steps == 0 or s.step == self.total_steps or minutes_due or preempted
        ):
            return
        self.commit()
        if preempted and s.step < self.total_steps:
            self.stop_preempted()

    def commit(self) -> None:
        """The checkpoint of the current step and its ledger part, committed together."""
        s = self.state
        if s.step % self.cfg.checkpoint.every_steps:  # off the steps schedule: `progress` logged no token point
            self.tracker.metrics(self.token_metrics(), step=s.step)
        s.val_last = self.last_val
        part_id = f"{self.spec.run_key}.s{s.segment:03d}.p{s.step:09d}"
        record = self._part_record(part_id) if self.ctx.is_main else None
        s.head_part_id = part_id
        if self.ctx.is_main:
            s.mlflow_run_id = self.tracker.run_id()
            s.capture_rng()
        with self.watchdog.in_phase(f"the checkpoint save of step {s.step}"), self.timeline.phase("save"):
            self.checkpoints.commit(s, self.part, record, self.model, self.optimizer, final=s.step == self.total_steps)
        self.part = self._new_part()
        self.saved_at, self.committed_step = time.time(), s.step

    def lease_lost(self) -> LeaseLost:
        """The stop of a job whose rank 0 lost the run's lease: why (rank 0's reason), and the last step trained,
        which this launch does not commit."""
        lease = self.preemption.lease
        why = (lease.lost if lease else None) or "rank 0 lost the run's lease"
        return LeaseLost(f"stopped after step {self.state.step}, nothing committed after it: {why}")

    def finish(self) -> RunResult:
        """The RunResult, the last MLflow metrics and the run record (`report`, below)."""
        return report(self)

    def _new_part(self) -> PartLog:
        return PartLog(self.state.step, self.state.loader.rows, self.objective.rows_of)

    def _part_record(self, part_id: str) -> PartRow:
        """The ledger part's row but for the counts (the checkpoint manager sums them over ranks)."""
        s, spec = self.state, self.spec
        return PartRow(
            part_id=part_id,
            prev_part_id=s.head_part_id or "",
            run_key=spec.run_key,
            parent_run_key=spec.parent_run_key or "",
            stage=spec.stage,
            segment=s.segment,
            step_first=self.part.first_step + 1,
            step_last=s.step,
            rows_first=self.part.first_rows,
            rows_last=s.loader.rows,
            **self.plan.to_dict(),  # the four tokens_per_step factors and their product
            planned_tokens=spec.plan.planned_tokens,
            allow_repeat=self.cfg.data.allow_repeat,
            replay_sources=json.dumps(self.cfg.data.replay_sources),
            passed_over=json.dumps(self.checkpoints.passed_over),
            mlflow_run_id=self.tracker.run_id(),
        )


def lr_at(step: int, total: int, cfg: StageConfig) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio x lr at the last step."""
    o = cfg.optim
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    progress_ = (step - o.warmup_steps) / max(1, total - o.warmup_steps)
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress_))))


# ---- the end of a run: its RunResult, the last MLflow metrics and dataset inputs, the run record ----


def report(run: Trainer) -> RunResult:
    """Rank 0 reports the run: mixture shares from the ledger, the last MLflow metrics and dataset
    inputs, the MLflow run ended, then the run record (what tells every reader the run is complete)."""
    result = run_result(run)
    if run.ctx.is_main:
        ledger = Ledger.in_store(run.store)
        result.mixture = mixture_shares(ledger, run.spec.run_key, run.cfg)
        run.tracker.metrics(final_metrics(result), step=result.steps)
        run.tracker.inputs(shard_inputs(run, {r.shard_id for r in ledger.consumed_by_shard(run.spec.run_key)}))
        result.mlflow_run_id = run.tracker.run_id()
        result.mlflow_experiment_id = run.tracker.mlflow.experiment_id
        result.mlflow_delivery = run.tracker.finish(
            {"ghostvis.checkpoint_uri": result.checkpoint_uri}, run.spec.run_key
        )
        key = (run.spec.stage, run.spec.run_key)
        text = json.dumps(result.to_dict(), indent=2, sort_keys=True)
        run.store.write_text("run_record", *key, text=text)
        if run.preemption.lease is not None:
            try:
                run.preemption.lease.commit("run_record", *key, text=text)
            except LeaseLost:
                run.store.delete("run_record", *key)
                raise
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
        checkpoint_uri=run.store.uri_of("checkpoint", spec.stage, spec.run_key, step_dir_name(s.step)),
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
        by_source[r.source] = by_source.get(r.source, 0) + r.tokens
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

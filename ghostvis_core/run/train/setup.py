"""Build a Trainer: the model (fresh, from the upstream checkpoint, or resumed by its CheckpointManager),
the objective, the optimizer, the parallel wrapper, the TrainState and the tracker. The order of these steps is part
of exact resume: the RNG state is restored after everything that draws from it is built."""

from __future__ import annotations

import torch

from ghostvis_core.errors import GhostvisError
from ghostvis_core.plan.batch import BatchPlan
from ghostvis_core.plan.budget import batch_plan
from ghostvis_core.plan.config import StageConfig
from ghostvis_core.run.model.gpt import GPT, attention_kernel
from ghostvis_core.run.model.vision import frozen_fingerprint
from ghostvis_core.run.train import checkpoint as ckpt
from ghostvis_core.run.train import float8
from ghostvis_core.run.train.checkpoint_manager import CheckpointManager
from ghostvis_core.run.train.clock import Clock
from ghostvis_core.run.train.dist import DistContext
from ghostvis_core.run.train.efficiency import efficiency
from ghostvis_core.run.train.feeds import watch_model_inputs
from ghostvis_core.run.train.live_metrics import Tracker
from ghostvis_core.run.train.muon import make_muon
from ghostvis_core.run.train.objectives import build_objective
from ghostvis_core.run.train.parallel import wrap
from ghostvis_core.run.train.precision import use_bf16, use_compile
from ghostvis_core.run.train.preemption import PreemptionFlag
from ghostvis_core.run.train.state import TrainState
from ghostvis_core.run.train.timeline import Timeline
from ghostvis_core.run.train.trainer import Trainer
from ghostvis_core.run.train.watchdog import Watchdog
from ghostvis_core.runs.launch_spec import LaunchSpec
from ghostvis_core.runs.lookup import checkpoint_of
from ghostvis_core.runs.reasons import HUNG
from ghostvis_core.store import open_store
from ghostvis_core.store.lease import Lease


def setup(spec: LaunchSpec, ctx: DistContext, lease: Lease | None = None) -> Trainer:
    """The Trainer of `spec` on this rank; `lease`: rank 0's hold on the run identity, which fences every commit
    and stops the ranks once it is lost (None on the other ranks, and where no launch took one)."""
    clock = Clock()
    timeline = Timeline(spec.run_key, spec.stage, enabled=ctx.is_main)
    timeline.waited(lease.waited if lease is not None else None)  # a job launched by hand waited for the lease
    cfg = spec.config
    plan = run_batch_plan(spec, ctx)
    store = open_store(spec.store)
    torch.manual_seed(cfg.data.seed)
    model = build_model(cfg, ctx)
    checkpoints = checkpoint_manager(spec, ctx, store, lease)
    checkpoints.timeline = timeline
    with timeline.phase("load"):
        resume = checkpoints.newest()
        state = _starting_state(spec, plan, checkpoints, resume, model)
    objective = build_objective(spec, cfg)
    objective.prepare_model(model)
    frozen_before = frozen_fingerprint(model) if any(not p.requires_grad for p in model.parameters()) else None
    bf16 = use_bf16(cfg.runtime.precision, ctx.device)
    parallel = wrap(model, ctx, cfg.parallel.strategy, bf16)  # before the optimizer: FSDP replaces the params
    optimizer = make_optimizer(parallel.model, cfg, ctx.device)
    if resume is not None:
        with timeline.phase("load"):
            checkpoints.load_optimizer(resume, parallel.model, optimizer)
        state.restore_rng()
    _check_resumable(spec, state, plan.tokens_per_step)
    state.segment += 1
    state.world_size = plan.world_size
    timeline.ready(state.segment, state.step)
    tracker = run_tracker(spec, ctx, state, bf16)
    trainer = Trainer(
        preemption=PreemptionFlag(cfg.runtime.preempt_grace_s, lease),
        watchdog=watchdog(spec, ctx, store, tracker, timeline, lease),
        timeline=timeline,
        spec=spec,
        cfg=cfg,
        ctx=ctx,
        plan=plan,
        store=store,
        parallel=parallel,
        optimizer=optimizer,
        objective=objective,
        bf16=bf16,
        tracker=tracker,
        checkpoints=checkpoints,
        state=state,
        clock=clock,
        resumed=resume is not None,
        frozen_before=frozen_before,
        efficiency=efficiency(cfg, ctx.device, bf16, plan.world_size),
    )
    watch_model_inputs(model, lambda: trainer.part.fed)  # the content proof digests what the model receives
    return trainer


def run_tracker(spec: LaunchSpec, ctx: DistContext, state: TrainState, bf16: bool) -> Tracker:
    """The segment's tracker: its MLflow run (the resumed one's) with the config, plan and attention kernel."""
    return Tracker(
        spec,
        ctx,
        {
            **spec.config.to_dict(),
            "plan": spec.plan.to_dict(),
            "run_key": spec.run_key,
            "attention_kernel": attention_kernel(ctx.device, bf16),  # for packed documents
        },
        run_id=state.mlflow_run_id,
        segment=state.segment,
    )


def checkpoint_manager(spec: LaunchSpec, ctx: DistContext, store, lease: Lease | None = None) -> CheckpointManager:
    c = spec.config
    return CheckpointManager(
        store,
        spec,
        ctx,
        lease=lease,
        keep_last=c.checkpoint.keep_last,
        async_save=c.checkpoint.async_save,
        sharded=c.parallel.strategy == "fsdp",
    )


def watchdog(
    spec: LaunchSpec, ctx: DistContext, store, tracker: Tracker, timeline: Timeline, lease: Lease | None = None
) -> Watchdog:
    """Every rank's progress watchdog (runtime.hang_timeout_s; 0: never fires); rank 0 reports slow steps, its
    waits for `lease`'s renewal are a phase of their own, and it ends its timeline when it fires (the hang's
    detection, the steps since the last commit)."""

    def report(message: str, idle_s: float, step: int) -> None:
        tracker.say(f"[{spec.stage}] {message}", pipes=True)
        tracker.metrics({"time/since_step_s": idle_s}, step=step)

    timeout = spec.config.runtime.hang_timeout_s
    dog = Watchdog(
        store, spec.stage, spec.run_key, ctx.rank, ctx.world_size, timeout, report=report if ctx.is_main else None
    )
    if lease is not None:
        lease.waiting = dog.in_phase
    dog.on_hung = lambda idle_s, step: timeline.end_safely(store, HUNG, step, detection_s=idle_s)
    return dog


def _starting_state(spec: LaunchSpec, plan: BatchPlan, checkpoints: CheckpointManager, resume, model) -> TrainState:
    """The resumed checkpoint's state (its weights loaded), or a fresh state with the weights of the stage's
    initial checkpoint (the upstream's, or an HF import's) when it has one."""
    if resume is not None:
        return checkpoints.load_model(resume, model)
    state = TrainState(spec.run_key, plan.tokens_per_step, plan.world_size, segment=-1)
    if spec.init_checkpoint:  # the stage that introduces the vision stack starts it fresh
        ckpt.load_model(
            checkpoint_of(checkpoints.store, spec.init_checkpoint),
            model,
            allow_missing=("vision.",) if spec.inputs.new_vision else (),
        )
    return state


def run_batch_plan(spec: LaunchSpec, ctx: DistContext) -> BatchPlan:
    """The spec's batch plan when the ranks actually started are the ones it planned; for another world size,
    grad_accum_steps derived again from batch.total_batch_tokens (else the world size is refused)."""
    cfg = spec.config
    if spec.plan.batch.world_size == ctx.world_size:
        return spec.plan.batch
    if cfg.batch.total_batch_tokens is None:
        raise GhostvisError(
            f"config batch.world_size={cfg.batch.world_size} but {ctx.world_size} ranks were started; "
            f"set batch.world_size={ctx.world_size} (or set batch.total_batch_tokens to derive grad_accum)"
        )
    return batch_plan(cfg.batch, ctx.world_size)


def build_model(cfg: StageConfig, ctx: DistContext) -> GPT:
    if cfg.runtime.float8:  # refused on hardware without float8 tensor cores, before anything is built
        float8.require_float8(ctx.device)
    model = GPT(cfg.model)
    if cfg.vision is not None:
        model.attach_vision(cfg.vision)
    model.to(ctx.device)
    model.grad_checkpointing = cfg.runtime.grad_checkpointing
    if cfg.runtime.float8:  # before compile and the parallel wrapper; parameter names do not change
        float8.convert(model)
    if use_compile(cfg.runtime.compile, ctx.device):
        model.compile_blocks()
    return model


def make_optimizer(model: torch.nn.Module, cfg: StageConfig, device) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (optim.name=adamw), or Muon for the hidden weight matrices
    and AdamW for the rest (muon); no weight decay on vectors (norms, biases)."""
    if cfg.optim.name == "muon":
        return make_muon(model, cfg.optim)
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(
        groups, lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2), fused=device.type == "cuda"
    )


def _check_resumable(spec: LaunchSpec, state: TrainState, tokens_per_step: int) -> None:
    if state.tokens_per_step != tokens_per_step:
        raise GhostvisError(
            f"run {spec.run_key}: the checkpoint was trained with tokens_per_step={state.tokens_per_step} "
            f"but this launch has {tokens_per_step}; resume with the same micro_batch_size x seq_len x "
            "world_size x grad_accum_steps product (e.g. halve grad_accum_steps when doubling the world size)"
        )

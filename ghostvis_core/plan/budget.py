"""The planner: tokens, steps, FLOPs, GPU-hours, cost and per-GPU memory from a stage config.

tokens_per_step = micro_batch_size x seq_len x world_size x grad_accum_steps. All four factors are
reported, because forgetting grad_accum or world_size is the classic way to train half the data.
The memory plan (`memory_plan`) is the arithmetic of what one GPU holds for the stage's parallel
strategy, precision, activation checkpointing and micro batch; the pre-flight refuses a launch on a
GPU it does not fit and names the fixes that would.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass

from ghostvis_core.errors import GhostvisError
from ghostvis_core.plan.batch import BatchPlan
from ghostvis_core.plan.config import BatchConfig, BudgetConfig, ModelConfig, StageConfig
from ghostvis_core.plan.model_shape import LOSS_CHUNK_ELEMENTS, count_params


@dataclass(frozen=True)
class GPU:
    memory_gb: float  # device memory, GB (1e9 bytes)
    bf16_flops: float  # dense bf16 peak FLOP/s (vendor datasheet, no sparsity)


# The accelerators the planner knows; a detected device is matched by name (`gpu_of`).
GPUS = {
    "H100": GPU(80, 989e12),  # SXM
    "H200": GPU(141, 989e12),
    "A100": GPU(80, 312e12),
    "A100-40GB": GPU(40, 312e12),
    "L40S": GPU(48, 362e12),
    "L4": GPU(24, 121e12),
    "RTX4090": GPU(24, 165e12),
}
GPU_PEAK_FLOPS = {name: g.bf16_flops for name, g in GPUS.items()}

# Assumed on-demand prices per GPU-hour (USD) for the report's cost estimate; set your own.
DEFAULT_GPU_PRICES = {"H100": 2.5, "A100": 1.5}

# The model FLOPs utilization the planner assumes when it turns a GPU's peak into a step time.
DEFAULT_MFU = 0.4


@dataclass(frozen=True)
class StepTime:
    """Where a plan's step time comes from: measured (`seconds`), or a GPU's peak bf16 FLOP/s at an
    assumed MFU. The planner, the hours budget, run modes and the report's cost table each state it this
    way; the GPU, when named, is also the one the memory plan is checked against."""

    seconds: float | None = None  # measured wall clock of one optimizer step
    gpu: str | None = None  # a GPUS name
    mfu: float = DEFAULT_MFU

    def seconds_per_step(self, step_flops: float, world_size: int) -> float | None:
        """The measured seconds, else a step's model FLOPs over world_size x the GPU's peak x mfu; None
        with neither."""
        if self.seconds is not None or self.gpu is None:
            return self.seconds
        if self.gpu not in GPUS:
            raise GhostvisError(f"unknown gpu '{self.gpu}'; known: {', '.join(GPUS)} (or pass a step time)")
        return step_flops / (world_size * GPU_PEAK_FLOPS[self.gpu] * self.mfu)


def batch_plan(batch: BatchConfig, world_size: int | None = None) -> BatchPlan:
    """Resolve grad_accum_steps, deriving it from total_batch_tokens when that is what was given."""
    ws = world_size if world_size is not None else batch.world_size
    per_micro_step = batch.micro_batch_size * batch.seq_len * ws
    if batch.total_batch_tokens is not None:
        if batch.total_batch_tokens % per_micro_step:
            raise GhostvisError(
                f"batch.total_batch_tokens={batch.total_batch_tokens} is not divisible by "
                f"micro_batch_size x seq_len x world_size = {batch.micro_batch_size} x {batch.seq_len} x "
                f"{ws} = {per_micro_step}; choose a total that is a multiple of {per_micro_step}"
            )
        accum = batch.total_batch_tokens // per_micro_step
        if batch.grad_accum_steps is not None and batch.grad_accum_steps != accum:
            raise GhostvisError(
                f"batch.grad_accum_steps={batch.grad_accum_steps} contradicts total_batch_tokens="
                f"{batch.total_batch_tokens} (which needs grad_accum_steps={accum}); set only one"
            )
    else:
        accum = batch.grad_accum_steps if batch.grad_accum_steps is not None else 1
    if accum <= 0:
        raise GhostvisError(f"batch.grad_accum_steps must be positive, got {accum}")
    return BatchPlan(batch.micro_batch_size, batch.seq_len, ws, accum)


@dataclass(frozen=True)
class Plan:
    """A stage's plan: its one BatchPlan (the four factors of a step, derived once, here) and what follows from
    it. Saved flat (the four factors and tokens_per_step beside the rest), as the audit reads a spec's plan."""

    batch: BatchPlan
    steps: int
    planned_tokens: int
    step_tokens_total: int  # steps x tokens_per_step: what the run will actually consume
    params_total: int
    params_non_embedding: int
    tokens_per_param: float
    flops: float  # 6 x N x D, N = non-embedding params, D = step_tokens_total
    flops_per_token: float  # model FLOPs per token, attention included: what a step time at an MFU uses
    step_time_s: float | None = None
    hours: float | None = None  # wall clock: steps x step_time_s
    gpu_hours: float | None = None
    cost: float | None = None
    memory: dict | None = None  # the MemoryPlan, per GPU

    def to_dict(self) -> dict:
        rest = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "batch"}
        return {**self.batch.to_dict(), **rest}

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        rest = {f.name: data[f.name] for f in dataclasses.fields(cls) if f.name != "batch"}
        return cls(batch=BatchPlan.of(data), **rest)


def plan(
    cfg: StageConfig,
    *,
    world_size: int | None = None,
    step_time: StepTime = StepTime(),
    price_per_gpu_hour: float | None = None,
    params: int | None = None,
) -> Plan:
    """Plan a stage. Time comes from `step_time`: measured, or a GPU's peak FLOP/s at an assumed MFU
    over the step's model FLOPs (`flops_per_token`, attention included, as the trainer counts them when
    it measures MFU); its GPU is the one the memory plan is checked against. `params` overrides N
    (non-embedding parameters) for a model that is not a preset."""
    bp = batch_plan(cfg.batch, world_size)
    counts = count_params(cfg.model)
    n = params if params is not None else counts["non_embedding"]
    tps = bp.tokens_per_step
    b = cfg.budget
    if b.steps is not None:
        steps = b.steps
        planned = steps * tps
    else:
        planned = int(b.tokens) if b.tokens is not None else int(round(b.tokens_per_param * n))
        steps = math.ceil(planned / tps)
    if steps <= 0:
        raise GhostvisError(f"budget gives {steps} steps; the budget must cover at least one step of {tps} tokens")
    d = steps * tps
    flops = 6.0 * n * d
    per_token = flops_per_token(cfg.model, bp.seq_len, params)
    step_time_s = step_time.seconds_per_step(per_token * tps, bp.world_size)
    hours = steps * step_time_s / 3600 if step_time_s is not None else None
    gpu_hours = hours * bp.world_size if hours is not None else None
    cost = gpu_hours * price_per_gpu_hour if gpu_hours is not None and price_per_gpu_hour is not None else None
    memory = memory_plan(cfg, world_size=bp.world_size, gpu=step_time.gpu, params=params)
    return Plan(
        batch=bp,
        steps=steps,
        planned_tokens=planned,
        step_tokens_total=d,
        params_total=counts["total"] if params is None else params,
        params_non_embedding=n,
        tokens_per_param=d / n,
        flops=flops,
        flops_per_token=per_token,
        step_time_s=step_time_s,
        hours=hours,
        gpu_hours=gpu_hours,
        cost=cost,
        memory=memory.to_dict(),
    )


def flops_per_token(m: ModelConfig, seq_len: int, params: int | None = None) -> float:
    """Training FLOPs per token: 6N (N non-embedding parameters, or `params`) plus attention's 12 x
    layers x d_attn x seq_len (QK^T and AV, forward and backward; PaLM's accounting, causal half not
    discounted)."""
    n = params if params is not None else count_params(m)["non_embedding"]
    return 6.0 * n + 12.0 * m.n_layers * m.n_heads * m.head_dim * seq_len


GB = 1e9
# Share of a GPU's memory training may plan to use: the CUDA context, NCCL buffers and allocator
# fragmentation take the rest.
USABLE_MEMORY = 0.9


def activation_elements(d: int, kv: int, ffn: int) -> int:
    """Elements autograd keeps per token and transformer block: the two norm inputs (2d), the inputs
    of wq/wkv, wo and w13 (3d), q, k, v and the attention output (2d + 2 kv), the SwiGLU gate and up
    (2 ffn), their product (ffn, w2's input) and the silu output (ffn). No T x T scores (flash or
    per-document attention)."""
    return 7 * d + 2 * kv + 4 * ffn


@dataclass(frozen=True)
class GpuFit:
    """Whether a memory plan fits one GPU: its memory, the share training may use (`USABLE_MEMORY`) and,
    when it does not fit, the fixes that would. Exists only with a GPU (named, or detected by its memory)."""

    gpu: str | None  # a GPUS name; None for a detected device the table does not know
    memory_gb: float  # the GPU's device memory
    usable_gb: float  # memory_gb x USABLE_MEMORY
    fits: bool
    fixes: list[str]  # each change that alone would fit, with its total; empty when it fits


@dataclass(frozen=True)
class MemoryPlan:
    """What one GPU holds, in GB: fp32 master weights, fp32 grads, AdamW's two fp32 moments (all
    divided by world_size under fsdp), the buffers of the strategy (ddp: a bf16 weight copy for
    autocast and the gradient buckets; fsdp: the gathered blocks in flight and the root), the
    activations of one micro batch, and the loss's logits chunk; with a GPU, whether it fits (`fit`)."""

    strategy: str
    bf16: bool
    grad_checkpointing: bool
    micro_batch_size: int
    seq_len: int
    world_size: int
    weights_gb: float
    grads_gb: float
    optimizer_gb: float
    buffers_gb: float
    activations_gb: float
    logits_gb: float
    total_gb: float
    fit: GpuFit | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> MemoryPlan:
        """A Plan's `memory` (saved by `to_dict`) as a MemoryPlan again, its fit a GpuFit: how `ghostvis
        plan` reads the plan it made to print it and to refuse it."""
        fit = data["fit"]
        return cls(**{**data, "fit": GpuFit(**fit) if fit is not None else None})


def memory_plan(
    cfg: StageConfig,
    *,
    world_size: int | None = None,
    gpu: str | None = None,
    gpu_memory_gb: float | None = None,
    params: int | None = None,
) -> MemoryPlan:
    """The per-GPU memory of a stage config (see MemoryPlan); with a GPU (a GPUS name, or a detected
    device's memory), its `fit`: whether it fits and, if not, the fixes that would make it fit."""
    ws = world_size if world_size is not None else cfg.batch.world_size
    base = _memory(cfg, ws, params)
    if gpu is None and gpu_memory_gb is None:
        return base
    if gpu is not None and gpu not in GPUS:
        raise GhostvisError(f"unknown gpu '{gpu}'; known: {', '.join(GPUS)}")
    mem = gpu_memory_gb if gpu_memory_gb is not None else GPUS[gpu].memory_gb
    usable = mem * USABLE_MEMORY
    fits = base.total_gb <= usable
    fixes = [] if fits else memory_fixes(cfg, ws, params, usable)
    return dataclasses.replace(base, fit=GpuFit(gpu, mem, round(usable, 2), fits, fixes))


def _memory(cfg: StageConfig, ws: int, params: int | None) -> MemoryPlan:
    m, b, rt = cfg.model, cfg.batch, cfg.runtime
    counts = count_params(m)
    n = params if params is not None else counts["total"]
    fsdp = cfg.parallel.strategy == "fsdp"
    bf16 = rt.precision != "fp32"
    cb = 2 if bf16 else 4  # bytes of a compute-precision element
    shard = ws if fsdp else 1
    kv = m.n_kv_heads * m.head_dim
    d = m.d_model
    block = 2 * d * m.n_heads * m.head_dim + 2 * d * kv + 3 * d * m.ffn_hidden + 2 * d  # wq, wo, wkv, ffn, norms
    root = max(0, n - m.n_layers * block)  # embeddings, lm_head, final norm (vision stack, if any)
    if fsdp:  # two blocks gathered (running + prefetched), their fp32 gradient before reduce-scatter, the root
        buffers = (2 * block + root) * cb + 4 * block
    else:  # ddp: gradient buckets (fp32; one process has no DDP), and autocast's bf16 weight copies
        buffers = (4 * n if ws > 1 else 0) + (2 * n if bf16 else 0)
    tokens = b.micro_batch_size * b.seq_len
    per_block = activation_elements(m.d_model, kv, m.ffn_hidden) * tokens * cb
    if rt.grad_checkpointing:  # each block's input kept, one block's activations recomputed at a time
        # the block inputs are the residual stream: bf16 under FSDP2 (it gathers bf16 weights), fp32 under
        # DDP's autocast (fp32 weights; tests/test_memory_measured.py holds the plan to a measured step)
        residual = cb if fsdp else 4
        activations = m.n_layers * m.d_model * tokens * residual + per_block
    else:
        activations = m.n_layers * per_block
    rows = min(tokens, max(1, LOSS_CHUNK_ELEMENTS // m.vocab_size))
    logits = rows * m.vocab_size * (cb + 8)  # compute-precision logits, their fp32 copy and its gradient
    parts = [4 * n / shard, 4 * n / shard, 8 * n / shard, buffers, activations, logits]
    gb = [round(x / GB, 3) for x in parts]
    return MemoryPlan(
        cfg.parallel.strategy,
        bf16,
        rt.grad_checkpointing,
        b.micro_batch_size,
        b.seq_len,
        ws,
        *gb,
        total_gb=round(sum(parts) / GB, 3),
    )


def memory_fixes(cfg: StageConfig, ws: int, params: int | None, usable_gb: float) -> list[str]:
    """Each change that alone would fit (or, if none does, all of them together), with its total."""
    b = cfg.batch
    accum = batch_plan(b, ws).grad_accum_steps
    options = []
    if cfg.parallel.strategy != "fsdp":
        options.append(("parallel.strategy=fsdp", {"parallel.strategy": "fsdp"}, ws))
    if not cfg.runtime.grad_checkpointing:
        options.append(("runtime.grad_checkpointing=true", {"runtime.grad_checkpointing": True}, ws))
    if b.micro_batch_size > 1:
        smaller = max(1, b.micro_batch_size // 2)
        options.append(
            (
                f"batch.micro_batch_size={smaller} with batch.grad_accum_steps="
                f"{accum * b.micro_batch_size // smaller} (same tokens_per_step)",
                {"batch.micro_batch_size": smaller},
                ws,
            )
        )
    if cfg.parallel.strategy == "fsdp":
        options.append((f"shard over {2 * ws} GPUs (batch.world_size={2 * ws}, grad_accum halved)", {}, 2 * ws))
    found = []
    for text, o, w in options:
        total = _memory(_changed(cfg, o), w, params).total_gb
        if total <= usable_gb:
            found.append(f"{text}: {total:.1f} GB")
    if found:
        return found
    together = {k: v for _, o, _ in options for k, v in o.items()}
    total = _memory(_changed(cfg, together), ws, params).total_gb
    return [
        f"{', '.join(together) or 'more GPUs'} together: {total:.1f} GB"
        + (
            ""
            if total <= usable_gb
            else f", still above {usable_gb:.1f} GB: more GPUs, a shorter seq_len or a GPU with more memory"
        )
    ]


def _changed(cfg: StageConfig, changes: dict[str, object]) -> StageConfig:
    """A what-if copy of a resolved config with `changes` (section.field -> value): a fix the plan prices."""
    sections: dict[str, dict[str, object]] = {}
    for dotted, value in changes.items():
        section, name = dotted.split(".")
        sections.setdefault(section, {})[name] = value
    return dataclasses.replace(cfg, **{s: dataclasses.replace(getattr(cfg, s), **v) for s, v in sections.items()})


def memory_refusal(stage: str, mp: MemoryPlan) -> str:
    """Why a memory plan does not fit its GPU (`mp.fit`), with its numbers and the fixes."""
    fit = mp.fit
    return (
        f"stage {stage}: {mp.total_gb:.1f} GB per GPU ({mp.weights_gb:.1f} weights + {mp.grads_gb:.1f} grads + "
        f"{mp.optimizer_gb:.1f} optimizer + {mp.buffers_gb:.1f} {mp.strategy} buffers + {mp.activations_gb:.1f} "
        f"activations at micro batch {mp.micro_batch_size} x {mp.seq_len} + {mp.logits_gb:.1f} logits) does not fit "
        f"{fit.gpu or 'the GPU'} ({fit.usable_gb:.1f} of {fit.memory_gb:.0f} GB usable) on {mp.world_size} GPUs; "
        f"fix: {'; or '.join(fit.fixes)}"
    )


def detected_gpu() -> tuple[str | None, float] | None:
    """(table name or None, memory GB) of this machine's first CUDA device; None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return gpu_of(props.name), props.total_memory / GB


def gpu_of(device_name: str) -> str | None:
    """The table's name for a detected device ('NVIDIA H100 80GB HBM3' -> H100), or None."""
    name = device_name.upper().replace(" ", "")
    for key in sorted(GPUS, key=len, reverse=True):
        if key.replace("-", "").upper() in name.replace("-", ""):
            return key
    return None


def budget_for_hours(cfg: StageConfig, hours: float, step_time: StepTime, params: int | None = None) -> StageConfig:
    """The config with budget.steps = the optimizer steps that fit in `hours` of wall clock, at a
    measured step time or at a GPU's peak x mfu (a run mode: "4 hours on one H100")."""
    step = plan(cfg, step_time=step_time, params=params).step_time_s
    if step is None:
        raise GhostvisError("a budget in hours needs a step time: give --step-time (measured) or --gpu (with --mfu)")
    steps = max(1, math.floor(hours * 3600 / step))
    return dataclasses.replace(cfg, budget=BudgetConfig(steps=steps))


@dataclass(frozen=True)
class SourcePlan:
    source: str
    weight: float
    needed_tokens: int
    available_tokens: int | None  # None: the ledger has no shards of this source yet
    epochs: float | None
    shards_available: int
    shards_needed: int | None  # shards (at this source's mean shard size) the budget takes
    shards: list[str]  # the first shards, in order, that cover the budget (all of them if short)

    def to_dict(self) -> dict:
        return asdict(self)


# The one-line rule `ghostvis plan` prints under its per-source table (LM stages).
LM_NEEDED_RULE = "needed = rows x seq_len + 1 boundary token per source: the last target token"


def lm_tokens_for_rows(n_rows: int, seq_len: int) -> int:
    """Tokens n_rows LM windows of a source read: a window of seq_len positions reads seq_len + 1
    tokens, and consecutive windows share one (a window's last target is the next one's first
    input), so rows x seq_len plus the final target. The arithmetic of `LMRows.tokens_for_rows`."""
    return n_rows * seq_len + (1 if n_rows else 0)


def mixture_rows(weights: dict[str, float], n_rows: int) -> dict[str, int]:
    """Rows of each source among the first n_rows global rows: the loader's MixtureSchedule (weights
    rounded to 1/1000, in the recipe's order), the split the pre-flight uses."""
    from ghostvis_core.plan.mixture import MixtureSchedule

    return dict(zip(weights, MixtureSchedule(list(weights.values())).rows_before(n_rows)))


def shortfall(source: str, needed: int, available: int, shards: int) -> str:
    """The pre-flight's refusal of a source the budget reads more than once without data.allow_repeat, with its
    fixes; `ghostvis plan --recipe` says the same before a run is launched."""
    epochs = needed / max(1, available)
    per_shard = available / max(1, shards)
    more = math.ceil((needed - available) / max(1.0, per_shard))
    return (
        f"source {source}: the budget needs {needed:,} tokens but {available:,} are available in "
        f"{shards} tokenized shards ({epochs:.2f} epochs); tokenize about {more} more shards "
        f"(~{per_shard:,.0f} tokens each) or lower the budget, or set data.allow_repeat=true to repeat "
        f"the data {epochs:.2f} times"
    )


def source_plan(
    weights: dict[str, float], planned_tokens: int, shards: dict[str, list[tuple[str, int]]], seq_len: int | None = None
) -> list[SourcePlan]:
    """Per source of a mixture: tokens the budget takes, epochs over what is tokenized, and which
    shards are needed (`shards`: source -> [(shard_id, tokens)] from the ledger).

    With `seq_len` (an LM stage; `planned_tokens` = steps x tokens_per_step), needed tokens are
    what the pre-flight checks: the source's rows of the mixture schedule x seq_len + 1 boundary
    token (`lm_tokens_for_rows`). Without it, planned_tokens split by weight (an estimate)."""
    total = sum(weights.values())
    if total <= 0 or any(w <= 0 for w in weights.values()):
        raise GhostvisError(f"recipe weights must be positive, got {weights}")
    if seq_len is not None:
        rows = mixture_rows(weights, -(-planned_tokens // seq_len))
        needed = {src: lm_tokens_for_rows(rows[src], seq_len) for src in weights}
    else:
        needed = {src: int(round(planned_tokens * w / total)) for src, w in weights.items()}
    return [_source_shards(src, w / total, needed[src], sorted(shards.get(src, []))) for src, w in weights.items()]


def _source_shards(source: str, weight: float, needed: int, have: list[tuple[str, int]]) -> SourcePlan:
    """A source's plan line: available tokens, epochs, and the first shards that cover `needed`."""
    if not have:
        return SourcePlan(source, weight, needed, None, None, 0, None, [])
    available = sum(t for _, t in have)
    chosen, acc = [], 0
    for sid, t in have:
        if acc >= needed:
            break
        chosen.append(sid)
        acc += t
    return SourcePlan(
        source,
        weight,
        needed,
        available,
        needed / available,
        len(have),
        math.ceil(needed / (available / len(have))),
        chosen,
    )

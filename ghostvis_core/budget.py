"""The planner: tokens, steps, FLOPs, GPU-hours and cost from a stage config.

tokens_per_step = micro_batch_size x seq_len x world_size x grad_accum_steps. All four factors are
reported, because forgetting grad_accum or world_size is the classic way to train half the data.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ghostvis_core.config import BatchConfig, StageConfig
from ghostvis_core.errors import GhostvisError
from ghostvis_core.model.gpt import count_params

# Dense bf16 peak FLOP/s per accelerator (vendor datasheets, no sparsity).
GPU_PEAK_FLOPS = {
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "RTX4090": 165e12,
}

# Assumed on-demand prices per GPU-hour (USD) for the report's cost estimate; set your own.
DEFAULT_GPU_PRICES = {"H100": 2.5, "A100": 1.5}


@dataclass(frozen=True)
class BatchPlan:
    micro_batch_size: int
    seq_len: int
    world_size: int
    grad_accum_steps: int

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch_size * self.seq_len * self.world_size * self.grad_accum_steps

    @property
    def rows_per_step(self) -> int:
        """Packed rows (of seq_len tokens) one optimizer step reads, over all ranks."""
        return self.micro_batch_size * self.world_size * self.grad_accum_steps


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
    micro_batch_size: int
    seq_len: int
    world_size: int
    grad_accum_steps: int
    tokens_per_step: int
    steps: int
    planned_tokens: int
    step_tokens_total: int  # steps x tokens_per_step: what the run will actually consume
    params_total: int
    params_non_embedding: int
    tokens_per_param: float
    flops: float  # 6 x N x D, N = non-embedding params, D = step_tokens_total
    step_time_s: float | None = None
    gpu_hours: float | None = None
    cost: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def plan(
    cfg: StageConfig,
    *,
    world_size: int | None = None,
    step_time_s: float | None = None,
    price_per_gpu_hour: float | None = None,
    gpu: str | None = None,
    mfu: float = 0.4,
    params: int | None = None,
) -> Plan:
    """Plan a stage. Time comes from step_time_s, or from a GPU's peak FLOP/s at an assumed MFU.
    `params` overrides N (non-embedding parameters) for a model that is not a preset."""
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
    if step_time_s is None and gpu is not None:
        if gpu not in GPU_PEAK_FLOPS:
            raise GhostvisError(f"unknown gpu '{gpu}'; known: {', '.join(GPU_PEAK_FLOPS)} (or pass a step time)")
        step_time_s = 6.0 * n * tps / (bp.world_size * GPU_PEAK_FLOPS[gpu] * mfu)
    gpu_hours = steps * step_time_s * bp.world_size / 3600 if step_time_s is not None else None
    cost = gpu_hours * price_per_gpu_hour if gpu_hours is not None and price_per_gpu_hour is not None else None
    return Plan(
        micro_batch_size=bp.micro_batch_size,
        seq_len=bp.seq_len,
        world_size=bp.world_size,
        grad_accum_steps=bp.grad_accum_steps,
        tokens_per_step=tps,
        steps=steps,
        planned_tokens=planned,
        step_tokens_total=d,
        params_total=counts["total"] if params is None else params,
        params_non_embedding=n,
        tokens_per_param=d / n,
        flops=flops,
        step_time_s=step_time_s,
        gpu_hours=gpu_hours,
        cost=cost,
    )


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
    from ghostvis_core.data.stream import MixtureSchedule

    return dict(zip(weights, MixtureSchedule(list(weights.values())).rows_before(n_rows)))


def source_plan(weights: dict[str, float], planned_tokens: int, shards: dict[str, list[tuple[str, int]]],
                seq_len: int | None = None) -> list[SourcePlan]:
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
    return SourcePlan(source, weight, needed, available, needed / available, len(have),
                      math.ceil(needed / (available / len(have))), chosen)

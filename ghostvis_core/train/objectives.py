"""Training objectives: what a stage reads, what its loss is, and how it is evaluated.

An objective hands the loop the micro-batches of one optimizer step (from the global row position),
computes a summed loss, and evaluates on held-out data. The loop does the rest (DDP, accumulation,
accounting, checkpoints), identically for every stage.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from ghostvis_core.budget import BatchPlan
from ghostvis_core.config import StageConfig
from ghostvis_core.data.loader import Batch, LMBatcher, micro_batch_rows
from ghostvis_core.data.stream import ShardRef, SourceStream
from ghostvis_core.errors import GhostvisError
from ghostvis_core.train.dist import DistContext, all_reduce_sum


class Objective(Protocol):
    def step_batches(self, first_row: int, plan: BatchPlan, rank: int) -> list[Batch]: ...

    def loss_sum(self, model, batch: Batch, device) -> torch.Tensor: ...

    def evaluate(self, model, ctx: DistContext, autocast) -> dict[str, float]: ...

    def rows_of(self, piece) -> tuple[int, int]: ...


def streams_for(shards: dict[str, list[dict]], seed: int) -> dict[str, SourceStream]:
    return {src: SourceStream(src, [ShardRef.from_dict(r) for r in refs], seed) for src, refs in shards.items()}


class LMObjective:
    """Next-token prediction on packed rows of a source mixture (pretraining-style stages)."""

    def __init__(self, cfg: StageConfig, train_shards: dict[str, list[dict]], val_shards: dict[str, list[dict]]):
        recipe = cfg.data.recipe
        missing = [s.source for s in recipe if s.source not in train_shards]
        if missing:
            raise GhostvisError(f"stage {cfg.stage}: no tokenized train shards for source(s) {missing}")
        streams = streams_for({s.source: train_shards[s.source] for s in recipe}, cfg.data.seed)
        self.batcher = LMBatcher([streams[s.source] for s in recipe], [s.weight for s in recipe], cfg.batch.seq_len)
        self.seq_len = cfg.batch.seq_len
        self.micro_batch_size = cfg.batch.micro_batch_size
        self.val_tokens = cfg.eval.val_tokens
        self.val = {src: LMBatcher([st], [1.0], self.seq_len) for src, st in streams_for(val_shards, cfg.data.seed).items()}
        self._all = {**{st.source: st for st in self.batcher.streams},
                     **{b.streams[0].source + "#val": b.streams[0] for b in self.val.values()}}

    def step_batches(self, first_row: int, plan: BatchPlan, rank: int) -> list[Batch]:
        return [self.batcher.batch(micro_batch_rows(first_row, m, rank, plan)) for m in range(plan.grad_accum_steps)]

    def loss_sum(self, model, batch: Batch, device) -> torch.Tensor:
        return model(batch.inputs.to(device), batch.targets.to(device), doc_ids=_dev(batch.doc_ids, device), reduction="sum")

    @torch.no_grad()
    def evaluate(self, model, ctx: DistContext, autocast) -> dict[str, float]:
        """Mean loss over the first val_tokens of each validation source (same rows every time)."""
        was_training = model.training
        model.eval()
        out: dict[str, float] = {}
        total_loss = total_n = 0.0
        for src, batcher in sorted(self.val.items()):
            stream = batcher.streams[0]
            n_rows = max(1, min(self.val_tokens, stream.total - 1) // self.seq_len)
            mine = list(range(ctx.rank, n_rows, ctx.world_size))
            loss = 0.0
            for i in range(0, len(mine), self.micro_batch_size):
                b = batcher.batch(mine[i : i + self.micro_batch_size])
                with autocast():
                    loss += float(self.loss_sum(model, b, ctx.device))
            loss, n = all_reduce_sum([loss, len(mine) * self.seq_len], ctx)
            out[f"val/loss/{src}"] = loss / n
            total_loss, total_n = total_loss + loss, total_n + n
        if total_n:
            out["val/loss"] = total_loss / total_n
            out["val/ppl"] = math.exp(min(out["val/loss"], 50.0))
        model.train(was_training)
        return out

    def rows_of(self, piece) -> tuple[int, int]:
        st = next(s for s in self.batcher.streams if s.source == piece.source)
        ref = next(r for r in st.refs if r.shard_id == piece.shard_id)
        return st.shard(ref).rows_of(piece.tok_start, piece.tok_end)

    def tokens_needed(self, steps: int, plan: BatchPlan) -> dict[str, int]:
        """Tokens each source must hold for `steps` steps (the +1 is the last row's final target)."""
        return {s: n + 1 for s, n in self.batcher.source_tokens(steps * plan.rows_per_step).items() if n}


def _dev(t, device):
    return None if t is None else t.to(device)


def build_objective(cfg: StageConfig, train_shards, val_shards) -> Objective:
    if cfg.objective == "lm":
        return LMObjective(cfg, train_shards, val_shards)
    raise GhostvisError(f"stage {cfg.stage}: unknown objective '{cfg.objective}'")

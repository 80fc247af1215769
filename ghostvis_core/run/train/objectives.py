"""Training objectives: what a stage reads, what its loss is, and how it is evaluated.

An objective hands the loop the micro-batches of one optimizer step (from the global row position),
computes a summed loss, and evaluates on held-out data (with the stage's evidence before and after
training). The loop does the rest (DDP, accumulation, accounting, checkpoints) for every stage.

- lm: next-token prediction on packed rows (pretrain, continued_pretrain, context_expansion,
  reasoning_mix)
- vision_align: caption loss through frozen encoder + LM; only resampler and projector train
- sft: assistant-token loss on packed conversations (attention kept inside each conversation)
- dpo: a preference loss (dpo.loss: DPO, IPO, DPO + SFT against a frozen reference model, the
  upstream checkpoint; or reference-free SimPO)
- grpo: group-relative policy optimisation on sampled completions, reward = the exact answer + a format
  reward for a well-formed answer line (rl)
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from ghostvis_core.data.bpe_tokenizer import load_tokenizer
from ghostvis_core.data.loader import (
    Batch,
    Batcher,
    CaptionRows,
    ChatRows,
    LMRows,
    PreferenceRows,
    micro_batch_rows,
    rank_batches,
)
from ghostvis_core.data.shard_ref import ShardRef
from ghostvis_core.data.stream import SourceStream
from ghostvis_core.errors import GhostvisError
from ghostvis_core.plan.batch import IGNORE_INDEX, BatchPlan
from ghostvis_core.plan.config import StageConfig
from ghostvis_core.run.model.gpt import GPT
from ghostvis_core.run.model.vision import decode_images
from ghostvis_core.run.train import evidence as ev
from ghostvis_core.run.train.dist import DistContext, all_reduce_sum
from ghostvis_core.run.train.grpo import GroupRows, grpo_loss_sum, held_out_reward, kl_k3, rollout_batch
from ghostvis_core.runs.launch_spec import LaunchSpec, Shards
from ghostvis_core.runs.lookup import checkpoint_of
from ghostvis_core.store import open_store


def streams_for(spec: LaunchSpec, shards: Shards, seed: int) -> dict[str, SourceStream]:
    """A stream per source; each fetches a shard's token file from the spec's store when it opens the shard
    (this node's copy: the spec names the file by its store URI)."""
    store = open_store(spec.store)

    def fetch(ref: ShardRef) -> Path:
        return store.fetch("token_shard", spec.tokenizer_id, ref.shard_id, ref.content_sha256)

    return {src: SourceStream(src, refs, seed, fetch) for src, refs in shards.items()}


class Objective:
    """Shared machinery: the train batcher from the recipe, validation rows, piece -> rows."""

    def __init__(self, spec: LaunchSpec, cfg: StageConfig):
        self.spec, self.cfg = spec, cfg
        self.tok = load_tokenizer(spec.tokenizer_id, open_store(spec.store))
        self.seq_len = cfg.batch.seq_len
        recipe = cfg.data.recipe
        missing = [s.source for s in recipe if s.source not in spec.train_shards]
        if missing:
            raise GhostvisError(f"stage {cfg.stage}: no tokenized train shards for source(s) {missing}")
        self.train_streams = streams_for(spec, {s.source: spec.train_shards[s.source] for s in recipe}, cfg.data.seed)
        self.val_streams = streams_for(spec, spec.val_shards, cfg.data.seed)
        self.batcher = Batcher(
            [self.row_source(self.train_streams[s.source], train=True) for s in recipe], [s.weight for s in recipe]
        )

    # --- per objective ---
    def row_source(self, stream: SourceStream, train: bool):
        raise NotImplementedError

    def image_rows(self, rows: type, stream: SourceStream):
        """A row source whose rows may hold an image (captions, chats): each image's placeholder token stands for
        the vision stack's latents (none without a vision stack: a text-only chat stage)."""
        v = self.cfg.vision
        pad, image = self.tok.special("<|pad|>"), self.tok.special("<|image|>")
        return rows(stream, self.seq_len, self.cfg.data.seed, pad, image, v.n_latents if v else None)

    def loss_sum(self, model, batch: Batch, device) -> torch.Tensor:
        return model(
            batch.inputs.to(device),
            batch.targets.to(device),
            doc_ids=_dev(batch.doc_ids, device),
            reduction="sum",
            **self.image_inputs(batch, device),
        )

    @torch.no_grad()
    def evaluate(self, model, ctx: DistContext, autocast, evidence: bool) -> dict[str, float]:
        """Held-out loss per validation source (and overall), plus the stage's evidence."""
        was = model.training
        model.eval()
        out: dict[str, float] = {}
        tot = n = 0.0
        for src in sorted(self.val_streams):
            rs, rows = self.val_rows(src)
            loss = self.mean_loss(model, rs, rows, ctx, autocast)
            out[f"val/loss/{src}"] = loss
            tot, n = tot + loss * rows, n + rows
        if n:
            out["val/loss"] = tot / n
            out["val/ppl"] = math.exp(min(out["val/loss"], 50.0))
        if evidence:
            out.update(ev.compute(self, model, ctx, autocast, out))
        model.train(was)
        return out

    def prepare_model(self, model: GPT) -> None:
        """Set which parameters train (all, by default)."""

    def frozen_upstream(self, model: GPT) -> GPT:
        """The stage's starting checkpoint as a frozen reference model beside `model` (DPO, GRPO's KL)."""
        from ghostvis_core.run.train import checkpoint as ckpt

        ref = GPT(model.cfg)
        if self.cfg.vision is not None:
            ref.attach_vision(self.cfg.vision)
        ckpt.load_model(checkpoint_of(open_store(self.spec.store), self.spec.init_checkpoint), ref)
        return ref.to(model.embed.weight.device).eval().requires_grad_(False)

    # --- shared ---
    def step_batches(self, first_row: int, plan: BatchPlan, rank: int) -> list[Batch]:
        return [self.batcher.batch(micro_batch_rows(first_row, m, rank, plan)) for m in range(plan.grad_accum_steps)]

    def image_inputs(self, batch: Batch, device) -> dict:
        if not batch.images:
            return {}
        image_id = self.tok.special("<|image|>")
        images = decode_images(batch.images, self.cfg.vision.image_size).to(device)
        return {"images": images, "image_mask": batch.inputs.to(device) == image_id}

    def rows_of(self, piece) -> tuple[int, int]:
        st = self.train_streams[piece.source]
        ref = next(r for r in st.refs if r.shard_id == piece.shard_id)
        return st.shard(ref).rows_of(piece.tok_start, piece.tok_end)

    def val_rows(self, source: str, rows_cap: int | None = None) -> tuple[object, int]:
        rs = self.row_source(self.val_streams[source], train=False)
        n = max(1, min(self.cfg.eval.val_tokens // self.seq_len, rows_cap or 10**9, _rows_available(rs, self.seq_len)))
        return rs, n

    def mean_loss(self, model, rs, n_rows: int, ctx, autocast) -> float:
        """Mean loss over the first n_rows of a row source (rows split over ranks)."""
        total = count = 0.0
        for batch in rank_batches(rs, n_rows, ctx.rank, ctx.world_size, self.cfg.batch.micro_batch_size):
            with autocast():
                total += float(self.loss_sum(model, batch, ctx.device))
            count += batch.counts.loss_tokens
        total, count = all_reduce_sum([total, count], ctx)
        return total / max(1.0, count)


def _rows_available(rs, seq_len: int) -> int:
    if isinstance(rs, LMRows):
        return max(1, (rs.available_tokens - 1) // seq_len)
    if isinstance(rs, ChatRows):
        return len(rs.plan(0))
    return len(rs.index.docs) * (2 if isinstance(rs, PreferenceRows) else 1)


def _dev(t, device):
    return None if t is None else t.to(device)


class LMObjective(Objective):
    """Next-token prediction on packed windows; a source continues where the stage's lineage
    stopped reading it, unless it is declared replay (then it is read again from the start)."""

    def row_source(self, stream, train):
        start = self.spec.inputs.stream_offsets.get(stream.source, 0) if train else 0
        return LMRows(stream, self.seq_len, start)


class VisionAlignObjective(Objective):
    def row_source(self, stream, train):
        return self.image_rows(CaptionRows, stream)

    def prepare_model(self, model: GPT) -> None:
        for p in model.parameters():
            p.requires_grad_(False)
        for p in model.vision.trainable_for_alignment():
            p.requires_grad_(True)


class SFTObjective(Objective):
    def row_source(self, stream, train):
        return self.image_rows(ChatRows, stream)

    def prepare_model(self, model: GPT) -> None:
        if model.vision is not None:  # the aligned vision stack is used, not trained, in SFT
            for p in model.vision.parameters():
                p.requires_grad_(False)


class DPOObjective(Objective):
    """Preference optimisation on (chosen, rejected) pairs; the loss per pair is the stage's `dpo.loss`,
    as TRL defines it. pc, pr: the policy's summed log-probs of the chosen and rejected response; rc, rr:
    the frozen reference's (the upstream checkpoint); avg x: x over the response's token count.

    - sigmoid (DPO):  -log sigmoid(beta x ((pc - rc) - (pr - rr)))
    - ipo:            ((avg pc - avg rc) - (avg pr - avg rr) - 1 / (2 beta))^2   (TRL length-averages for IPO)
    - simpo:          -log sigmoid(beta x (avg pc - avg pr) - gamma); reference-free, so no reference is built
    - sft_dpo:        sigmoid + alpha x (-avg pc), the NLL of the chosen response (TRL's rpo_alpha), which
                      keeps the chosen answers likely while the margin grows

    loss_sum sums over pairs (the loop divides by the pairs, loss_units); per-pair length averages keep
    a pair's loss independent of what else is in its micro-batch."""

    def __init__(self, spec, cfg):
        if cfg.batch.micro_batch_size % 2:
            raise GhostvisError(
                f"dpo: batch.micro_batch_size={cfg.batch.micro_batch_size} must be even "
                "(each preference pair is two rows)"
            )
        super().__init__(spec, cfg)
        self.dpo = cfg.dpo
        self.ref: GPT | None = None

    def row_source(self, stream, train):
        return PreferenceRows(stream, self.seq_len, self.cfg.data.seed, self.tok.special("<|pad|>"))

    def prepare_model(self, model: GPT) -> None:
        if model.vision is not None:
            for p in model.vision.parameters():
                p.requires_grad_(False)
        if self.uses_reference:  # simpo: no second model in memory, no reference forward pass
            self.ref = self.frozen_upstream(model)

    def step_batches(self, first_row, plan, rank):
        batches = super().step_batches(first_row, plan, rank)
        for b in batches:
            b.loss_units = b.inputs.shape[0] // 2
        return batches

    def sequence_logps(self, model, batch: Batch, device) -> torch.Tensor:
        lp = model(batch.inputs.to(device), batch.targets.to(device), reduction="logprobs")
        return lp.sum(-1)

    @property
    def uses_reference(self) -> bool:
        return self.dpo.loss != "simpo"

    def scores(self, model, batch: Batch, device) -> dict[str, torch.Tensor]:
        """Per pair (chosen rows even, rejected odd): the policy's summed response log-probs pc, pr, the
        reference's rc, rr (unless the loss is reference-free) and the response token counts nc, nr."""
        n = (batch.targets != IGNORE_INDEX).sum(-1).clamp_min(1).to(device)
        pol = self.sequence_logps(model, batch, device)
        s = {"pc": pol[0::2], "pr": pol[1::2], "nc": n[0::2], "nr": n[1::2]}
        if self.uses_reference:
            with torch.no_grad():
                ref = self.sequence_logps(self.ref, batch, device)
            s["rc"], s["rr"] = ref[0::2], ref[1::2]
        return s

    def pair_losses(self, s: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per pair: the loss of the stage's variant and the implicit rewards of the chosen and rejected
        response (TRL's: beta x the log-ratio the loss compares; for simpo beta x avg log-prob)."""
        d = self.dpo
        if d.loss == "simpo":
            chosen, rejected = d.beta * s["pc"] / s["nc"], d.beta * s["pr"] / s["nr"]
            return -F.logsigmoid(chosen - rejected - d.gamma), chosen, rejected
        if d.loss == "ipo":
            hc, hr = (s["pc"] - s["rc"]) / s["nc"], (s["pr"] - s["rr"]) / s["nr"]
            return (hc - hr - 1 / (2 * d.beta)) ** 2, d.beta * hc, d.beta * hr
        chosen, rejected = d.beta * (s["pc"] - s["rc"]), d.beta * (s["pr"] - s["rr"])
        losses = -F.logsigmoid(chosen - rejected)
        if d.loss == "sft_dpo":
            losses = losses - d.alpha * s["pc"] / s["nc"]
        return losses, chosen, rejected

    def loss_sum(self, model, batch, device):
        return self.pair_losses(self.scores(model, batch, device))[0].sum()

    @torch.no_grad()
    def evaluate(self, model, ctx, autocast, evidence):
        was = model.training
        model.eval()
        out = {}
        for src in sorted(self.val_streams):
            rs, rows = self.val_rows(src)
            sums = [0.0, 0.0, 0.0, 0.0, 0.0]  # loss, pref_acc, margin, chosen>rejected, pairs
            for batch in rank_batches(rs, rows, ctx.rank, ctx.world_size, self.cfg.batch.micro_batch_size, group=2):
                with autocast():
                    s = self.scores(model, batch, ctx.device)
                    losses, chosen, rejected = self.pair_losses(s)
                sums[0] += float(losses.sum())
                sums[1] += float((chosen > rejected).sum())
                sums[2] += float((chosen - rejected).sum())
                sums[3] += float((s["pc"] > s["pr"]).sum())
                sums[4] += len(losses)
            sums = all_reduce_sum(sums, ctx)
            n = max(1.0, sums[4])
            out["val/loss"] = out[f"val/loss/{src}"] = sums[0] / n
            if evidence:
                out["evidence/preference_accuracy"] = sums[1] / n
                out["evidence/reward_margin"] = sums[2] / n
                out["evidence/chosen_preferred"] = sums[3] / n
        model.train(was)
        return out


class GRPOObjective(Objective):
    """GRPO on problems with a verifiable answer (ghostvis_core/run/train/grpo.py): each step samples G
    completions per prompt from the current policy, rewards the answer its source's reward rule accepts (and a
    well-formed last line) and trains on the generated tokens with group-relative advantages; optionally a KL
    term to the frozen upstream model."""

    def __init__(self, spec, cfg):
        super().__init__(spec, cfg)
        self.policy: GPT | None = None
        self.ref: GPT | None = None

    def row_source(self, stream, train):
        rule = self.spec.inputs.reward_rules[stream.source]  # the source's reward rule, from its manifest
        return GroupRows(stream, self.seq_len, self.cfg.data.seed, self.tok, self.cfg.grpo, rule)

    def prepare_model(self, model: GPT) -> None:
        """Sampling uses the policy's own weights (DDP shares them with its wrapper); the reference is
        loaded only when the KL term has a weight."""
        if model.vision is not None:
            for p in model.vision.parameters():
                p.requires_grad_(False)
        self.policy = model
        if self.cfg.grpo.kl_beta:
            self.ref = self.frozen_upstream(model)

    def step_batches(self, first_row, plan, rank):
        src = self.batcher.sources[0]
        return [
            rollout_batch(src, list(micro_batch_rows(first_row, m, rank, plan)), self.policy, self.cfg.data.seed)
            for m in range(plan.grad_accum_steps)
        ]

    def loss_sum(self, model, batch, device):
        """The GRPO loss summed over the batch's generated tokens; with a reference, the batch also keeps its KL
        sum (`kl_sum`, on the device) for the step's `rl/kl`."""
        inputs, targets = batch.inputs.to(device), batch.targets.to(device)
        logps = model(inputs, targets, reduction="logprobs")
        mask, ref = targets != IGNORE_INDEX, None
        if self.ref is not None:
            with torch.no_grad():
                ref = self.ref(inputs, targets, reduction="logprobs")
                batch.kl_sum = (kl_k3(logps.detach(), ref) * mask).sum()
        return grpo_loss_sum(logps, ref, batch.advantages.to(device), mask, self.cfg.grpo.kl_beta)

    @torch.no_grad()
    def evaluate(self, model, ctx, autocast, evidence):
        """Held-out reward, exact-answer accuracy and format rate (greedy and sampled), the stage's evidence
        before and after training."""
        src = self.row_source(self.val_streams[sorted(self.val_streams)[0]], train=False)
        out = held_out_reward(src, model, self.cfg.eval.samples, ctx, self.cfg.data.seed)
        if evidence:
            out.update(ev.compute(self, model, ctx, autocast, out))
        return out


OBJECTIVES = {
    "lm": LMObjective,
    "vision_align": VisionAlignObjective,
    "sft": SFTObjective,
    "dpo": DPOObjective,
    "grpo": GRPOObjective,
}


def build_objective(spec: LaunchSpec, cfg: StageConfig) -> Objective:
    if cfg.objective not in OBJECTIVES:
        raise GhostvisError(f"stage {cfg.stage}: unknown objective '{cfg.objective}'; one of {', '.join(OBJECTIVES)}")
    return OBJECTIVES[cfg.objective](spec, cfg)

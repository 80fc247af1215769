"""Evidence that a stage did its job, measured on held-out data before (step 0, the upstream
checkpoint) and after training. A stage's config lists which evidence it records (eval.evidence);
each function returns `evidence/...` metrics.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import torch

from ghostvis_core.data.chat import marker_starts
from ghostvis_core.data.loader import expand_images, rank_batches, rank_share
from ghostvis_core.plan.batch import IGNORE_INDEX
from ghostvis_core.run.train.dist import all_reduce_sum

ANSWER = re.compile(r"Answer:\s*(-?\d+)")
# Completions sampled (temperature 1) per held-out problem for `reasoning`'s answer accuracy, as rl samples a group
ANSWER_SAMPLES = 8
# Their generators: seeded data.seed x 1_000_003 + ANSWER_SEED + problem x ANSWER_SAMPLES + j, the same before and
# after training (the difference is the model's, not the draw's)
ANSWER_SEED = 2**41


def domain_loss(obj, model, ctx, autocast, metrics) -> dict[str, float]:
    """Held-out loss on the recipe's most heavily weighted source (the emphasised domain)."""
    src = max(obj.cfg.data.recipe, key=lambda s: s.weight).source
    return {"evidence/domain_loss": metrics[f"val/loss/{src}"]} if f"val/loss/{src}" in metrics else {}


def reward(obj, model, ctx, autocast, metrics) -> dict[str, float]:
    """rl: the mean reward of completions to held-out problems sampled as rl samples them, and its two parts
    (exact-answer accuracy, well-formed answer rate): the policy's expected reward, what the stage raises; the
    greedy completion's three figures beside them, as context (grpo.py `held_out_reward`)."""
    names = {
        "val/sampled_reward": "evidence/reward",
        "val/sampled_exact_accuracy": "evidence/exact_accuracy",
        "val/sampled_format_rate": "evidence/format_rate",
        "val/reward": "evidence/greedy_reward",
        "val/exact_accuracy": "evidence/greedy_exact_accuracy",
        "val/format_rate": "evidence/greedy_format_rate",
    }
    return {e: metrics[v] for v, e in names.items() if v in metrics}


def beyond_context_loss(obj, model, ctx, autocast, metrics) -> dict[str, float]:
    """Held-out loss at positions beyond the upstream model's context vs within it, with this
    stage's RoPE settings and with the upstream's (the model as it was before the stage)."""
    out = _context_losses(obj, model, ctx, autocast, "")
    saved, up = model.cfg, obj.spec.inputs
    model.cfg = dataclasses.replace(saved, rope_base=up.upstream_rope_base, rope_scaling=up.upstream_rope_scaling)
    model._rope_len = 0
    try:
        out.update(_context_losses(obj, model, ctx, autocast, "_upstream_rope"))
    finally:
        model.cfg, model._rope_len = saved, 0
    return out


def _context_losses(obj, model, ctx, autocast, suffix: str) -> dict[str, float]:
    old = int(obj.spec.inputs.old_seq_len)
    sums = [0.0, 0.0, 0.0, 0.0]  # beyond loss, beyond count, within loss, within count
    for src in sorted(obj.val_streams):
        rs, rows = obj.val_rows(src)
        for batch in rank_batches(rs, rows, ctx.rank, ctx.world_size, obj.cfg.batch.micro_batch_size):
            with autocast():
                per = model(batch.inputs.to(ctx.device), batch.targets.to(ctx.device), reduction="none").float()
            valid = (batch.targets != IGNORE_INDEX).to(ctx.device)
            sums[0] += float(per[:, old:][valid[:, old:]].sum())
            sums[1] += float(valid[:, old:].sum())
            sums[2] += float(per[:, :old][valid[:, :old]].sum())
            sums[3] += float(valid[:, :old].sum())
    s = all_reduce_sum(sums, ctx)
    return {
        f"evidence/loss_beyond_context{suffix}": s[0] / max(1, s[1]),
        f"evidence/loss_within_context{suffix}": s[2] / max(1, s[3]),
    }


def _val_docs(obj, source: str, limit: int):
    """Held-out documents of a source: (shard, doc index) pairs, the first `limit` of them."""
    stream = obj.val_streams[source]
    out = []
    for ref in stream.refs:
        shard = stream.shard(ref)
        out += [(shard, d) for d in range(shard.num_docs)]
    return out[:limit]


def reasoning(obj, model, ctx, autocast, metrics) -> dict[str, float]:
    """Answer-token loss given the question and worked solution, and answer accuracy when the model writes its
    own solution from the question alone: over ANSWER_SAMPLES completions sampled per problem (pass@1 over k
    samples, as DeepSeek-R1 reports it; a small model's right answers are among its samples long before greedy
    decoding writes them), and of the greedy completion (context)."""
    tok = obj.tok
    source = obj.spec.inputs.reasoning_source
    docs = _val_docs(obj, source, 4 * obj.cfg.eval.samples)
    sums = [0.0, 0.0, 0.0, 0.0, 0.0]  # answer loss, answer tokens, greedy correct, problems, sampled correct
    for k in rank_share(len(docs), ctx.rank, ctx.world_size):
        shard, d = docs[k]
        text = tok.decode(shard.doc_tokens(d)[1:].tolist())
        head, sep, answer = text.rpartition("Answer:")
        if not sep:
            continue
        prefix = [tok.bos, *tok.encode(head + sep)]
        ans = tok.encode(answer.rstrip())
        ids = torch.tensor([prefix + ans], device=ctx.device)
        targets = torch.full_like(ids, IGNORE_INDEX)
        targets[0, len(prefix) - 1 : -1] = ids[0, len(prefix) :]
        with autocast():
            sums[0] += float(model(ids, targets, reduction="sum"))
        sums[1] += len(ans)
        if k < obj.cfg.eval.samples:
            question = [tok.bos, *tok.encode(text.split("\n", 1)[0] + "\n")]
            seed = obj.cfg.data.seed * 1_000_003 + ANSWER_SEED + k * ANSWER_SAMPLES
            greedy, sampled = _right_answers(model, tok, question, answer.strip(), obj.cfg.eval.sample_max_tokens, seed)
            sums[2:5] = [sums[2] + greedy, sums[3] + 1, sums[4] + sampled]
    s = all_reduce_sum(sums, ctx)
    return {
        "evidence/answer_loss": s[0] / max(1, s[1]),
        "evidence/answer_accuracy": s[4] / max(1, s[3]),
        "evidence/greedy_answer_accuracy": s[2] / max(1, s[3]),
    }


def _right_answers(model, tok, question: list[int], answer: str, limit: int, seed: int) -> tuple[bool, float]:
    """Whether the greedy completion's first `Answer: n` line gives the problem's answer, and the share of
    ANSWER_SAMPLES completions sampled at temperature 1 (generators seeded seed, seed + 1, ...) whose does."""
    stops = (tok.bos, tok.eot)
    gens = [torch.Generator(device=model.embed.weight.device).manual_seed(seed + j) for j in range(ANSWER_SAMPLES)]
    sampled = model.generate_rows(
        question, gens, limit, temperature=1.0, vocab=tok.vocab_size, ends=lambda row: row[-1] in stops
    )
    right = [
        (m := ANSWER.search(tok.decode([t for t in out if t < tok.bos]))) is not None and m.group(1) == answer
        for out in [model.generate(question, limit, stop_tokens=stops), *sampled]
    ]
    return right[0], sum(right[1:]) / ANSWER_SAMPLES


def caption_image_gap(obj, model, ctx, autocast, metrics) -> dict[str, float]:
    """Held-out caption loss with each caption's own image vs with another sample's image."""
    sums = [0.0, 0.0, 0.0]  # true, shuffled, tokens
    for src in sorted(obj.val_streams):
        rs, rows = obj.val_rows(src)
        # a batch of one cannot give a caption another sample's image
        for batch in rank_batches(
            rs, rows, ctx.rank, ctx.world_size, max(2, obj.cfg.batch.micro_batch_size), min_rows=2
        ):
            inputs = obj.image_inputs(batch, ctx.device)
            with autocast():
                true = model(batch.inputs.to(ctx.device), batch.targets.to(ctx.device), reduction="sum", **inputs)
                inputs["images"] = inputs["images"].roll(1, dims=0)
                wrong = model(batch.inputs.to(ctx.device), batch.targets.to(ctx.device), reduction="sum", **inputs)
            sums[0] += float(true)
            sums[1] += float(wrong)
            sums[2] += batch.counts.loss_tokens
    s = all_reduce_sum(sums, ctx)
    t, w = s[0] / max(1, s[2]), s[1] / max(1, s[2])
    return {
        "evidence/caption_loss_true_image": t,
        "evidence/caption_loss_shuffled_image": w,
        "evidence/caption_image_gap": w - t,
    }


def reply_endings(obj, model, ctx, autocast, metrics) -> dict[str, float]:
    """Greedy replies to held-out prompts: the fraction that end with <|eot|> within the length
    limit, and the fraction that write a role marker (running on into another turn)."""
    tok = obj.tok
    # a role marker may be several ids (a tokenizer brought as a file: "<|im_start|>assistant\n"); its first
    # (<|im_start|>) is what a reply running on into another turn writes
    assistant, image = tok.marker("<|assistant|>"), tok.special("<|image|>")
    roles = {tok.marker(f"<|{r}|>")[0] for r in ("system", "user", "assistant")}
    v = obj.cfg.vision
    docs = []
    for src in sorted(obj.val_streams):
        docs += _val_docs(obj, src, 10 * obj.cfg.eval.samples)
    prompts = []
    for shard, d in docs:
        ids = shard.doc_tokens(d).astype(np.int64)
        ends = [i + len(assistant) for i in marker_starts(ids, assistant)]
        has_image = bool((ids == image).any())
        if len(ends) and (not has_image or v is not None):
            blob = shard.doc_value("image", d) if has_image else None
            prompts.append((ids[: ends[-1]], blob))
        if len(prompts) == obj.cfg.eval.samples:
            break
    sums = [0.0, 0.0, 0.0]
    for k in rank_share(len(prompts), ctx.rank, ctx.world_size):
        ids, blob = prompts[k]
        kwargs = {}
        if blob is not None:
            from ghostvis_core.run.model.vision import decode_images

            ids = expand_images(ids, image, v.n_latents)
            kwargs = {"images": (decode_images([blob], v.image_size).to(ctx.device), image)}
        out = model.generate(ids.tolist(), obj.cfg.eval.sample_max_tokens, stop_tokens=(tok.eot,), **kwargs)
        sums[0] += float(bool(out) and out[-1] == tok.eot)
        sums[1] += float(any(t in roles for t in out))
        sums[2] += 1
    s = all_reduce_sum(sums, ctx)
    return {"evidence/eot_rate": s[0] / max(1, s[2]), "evidence/role_leak_rate": s[1] / max(1, s[2])}


EVIDENCE = {
    "domain_loss": domain_loss,
    "beyond_context_loss": beyond_context_loss,
    "reasoning": reasoning,
    "caption_image_gap": caption_image_gap,
    "reply_endings": reply_endings,
    "reward": reward,
}


def compute(obj, model, ctx, autocast, metrics: dict[str, float] | None = None) -> dict[str, float]:
    out: dict[str, float] = {}
    for name in obj.cfg.eval.evidence:
        out.update(EVIDENCE[name](obj, model, ctx, autocast, metrics or {}))
    return out

"""Evaluation of a trained stage: bits per byte, sampled completions for fixed prompts, and a small
multiple-choice benchmark scored by lowest answer loss (as CORE scores its tasks), built locally.

Bits per byte divides the summed loss (in bits) by the UTF-8 bytes of the predicted tokens, so it
compares models across tokenizers. The benchmark's items come from templates and from held-out
shards: arithmetic, capitals, and "which line comes next" on held-out code and prose.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ghostvis_core.data.bpe_tokenizer import Tokenizer
from ghostvis_core.data.eval_texts import BENCHMARK_PER_TASK, BENCHMARK_SEED, PROMPTS, template_choices
from ghostvis_core.data.token_shard import TokenShard
from ghostvis_core.run.trained_model import TrainedStage


@contextmanager
def one_thread() -> Iterator[None]:
    """Score on one torch thread, restored after: the caller runs stages side by side instead. Scoring
    shares its host with the process that runs it (Dagster) and often with a training job's ranks: with
    a thread per core, every op of a small model waits at OpenMP's barrier for a thread the other load
    took the core from (docs/architecture.md, "Fixed costs", has the measured walls)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@dataclass(frozen=True)
class Choice:
    task: str
    context: list[int]
    options: list[list[int]]
    answer: int


@torch.no_grad()
def bits_per_byte(ts: TrainedStage, val_shards: dict[str, list[dict]], max_tokens: int = 32768) -> dict[str, float]:
    """Per held-out text source: summed next-token loss in bits / bytes of the predicted tokens.
    (`val_shards`: source -> ledger shard records of plain-text validation shards.)"""
    tok, model = ts.tok, ts.model
    n_text = tok.enc.n_vocab - len(tok.enc.special_tokens_set)
    token_bytes = np.array(
        [len(tok.enc.decode_single_token_bytes(i)) if i < n_text else 0 for i in range(tok.enc.n_vocab)], dtype=np.int64
    )
    L = min(ts.config.model.max_seq_len, 1024)
    out = {}
    for source, refs in sorted(val_shards.items()):
        nats = n_bytes = 0.0
        for ref in refs:
            shard = TokenShard.open(Path(ref["path"]), ref["shard_id"])
            ids = shard.slice(0, min(max_tokens, shard.num_tokens)).astype(np.int64)  # its blocks checked
            for a in range(0, len(ids) - 1, L):
                chunk = torch.from_numpy(ids[a : a + L + 1])
                x, y = chunk[None, :-1], chunk[None, 1:].clone()
                y[y >= n_text] = -1  # special tokens have no bytes; leave them out
                nats += float(model(x, y, reduction="sum"))
                n_bytes += float(token_bytes[y[y >= 0].numpy()].sum())
        if n_bytes:
            out[source] = nats / math.log(2) / n_bytes
    return out


@torch.no_grad()
def samples(ts: TrainedStage, prompts=PROMPTS, max_new_tokens: int = 32) -> list[dict[str, str]]:
    """Greedy completions of fixed prompts (chat stages answer through the chat template)."""
    from ghostvis_core.data.chat import render_prompt

    tok, out = ts.tok, []
    chat = ts.config.objective in ("sft", "dpo")
    for prompt in prompts:
        ids = render_prompt(tok, [{"role": "user", "content": prompt}]) if chat else [tok.bos, *tok.encode(prompt)]
        gen = ts.model.generate(ids, max_new_tokens, stop_tokens=(tok.eot, tok.bos))
        text = tok.decode([t for t in gen if t not in (tok.eot, tok.bos)])
        out.append({"prompt": prompt, "completion": text, "ended": bool(gen) and gen[-1] in (tok.eot, tok.bos)})
    return out


def build_items(
    ts: TrainedStage, val_shards: dict[str, list[dict]], per_task: int = BENCHMARK_PER_TASK, seed: int = BENCHMARK_SEED
) -> list[Choice]:
    """Multiple-choice items: 4 options each, one correct; deterministic for a tokenizer and data."""
    tok, rng = ts.tok, random.Random(seed)
    items = [
        Choice(task, [tok.bos, *tok.encode(context)], [tok.encode(o) for o in options], answer)
        for task, context, options, answer in template_choices(rng, per_task)
    ]
    for source in sorted(val_shards):
        lines = _held_out_lines(ts, val_shards[source])
        if len(lines) < 8:
            continue
        for _ in range(per_task):
            i = rng.randrange(1, len(lines))
            context, right = lines[i - 1], lines[i]
            opts = [right, *rng.sample([line for line in lines if line != right], 3)]
            rng.shuffle(opts)
            items.append(
                Choice(
                    f"next_line/{source}",
                    [tok.bos, *tok.encode(context + "\n")],
                    [tok.encode(o) for o in opts],
                    opts.index(right),
                )
            )
    return items


def held_out_texts(tok: Tokenizer, refs: list[dict]) -> Iterator[str]:
    """The documents of held-out token shards as text (their leading <|bos|> dropped), in shard order."""
    for ref in refs:
        shard = TokenShard.open(Path(ref["path"]), ref["shard_id"])
        for d in range(shard.num_docs):
            yield tok.decode(shard.doc_tokens(d)[1:].tolist())


def _held_out_lines(ts: TrainedStage, refs: list[dict], limit: int = 2000) -> list[str]:
    lines: list[str] = []
    for text in held_out_texts(ts.tok, refs):
        lines += [line for line in text.splitlines() if 20 <= len(line.strip()) <= 120]
        if len(lines) >= limit:
            return lines
    return lines


@torch.no_grad()
def multiple_choice(ts: TrainedStage, items: list[Choice], batch_rows: int = 64) -> dict[str, float]:
    """Accuracy per task: the option with the lowest mean loss per token wins. Every (item, option)
    sequence is one padded row; rows are scored in batches (the padding carries no loss)."""
    seqs = [(it.context + opt, len(it.context)) for it in items for opt in it.options]
    mean_loss = np.zeros(len(seqs))
    for a in range(0, len(seqs), batch_rows):
        chunk = seqs[a : a + batch_rows]
        T = max(len(ids) for ids, _ in chunk)
        x = torch.zeros(len(chunk), T, dtype=torch.long)
        y = torch.full((len(chunk), T), -1, dtype=torch.long)
        for r, (ids, n_ctx) in enumerate(chunk):
            x[r, : len(ids)] = torch.tensor(ids)
            y[r, n_ctx - 1 : len(ids) - 1] = x[r, n_ctx : len(ids)]
        per_token = ts.model(x, y, reduction="none")
        mean_loss[a : a + len(chunk)] = (per_token.sum(1) / (y >= 0).sum(1)).numpy()
    right: dict[str, int] = {}
    total: dict[str, int] = {}
    k = 0
    for it in items:
        losses = mean_loss[k : k + len(it.options)]
        k += len(it.options)
        total[it.task] = total.get(it.task, 0) + 1
        right[it.task] = right.get(it.task, 0) + int(int(np.argmin(losses)) == it.answer)
    out = {task: right[task] / total[task] for task in total}
    out["overall"] = sum(right.values()) / max(1, sum(total.values()))
    return out

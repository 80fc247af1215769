"""Evaluation arithmetic on a small random model: the batched multiple-choice scorer picks the same
option as scoring each (context, option) alone, whatever the padding and batch boundaries."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import numpy as np
import torch

from ghostvis_core.plan.config import ModelConfig
from ghostvis_core.run.model.gpt import GPT
from ghostvis_core.verify.eval.benchmark import Choice, multiple_choice


def _model() -> GPT:
    torch.manual_seed(0)
    m = GPT(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=64))
    return m.eval()


def _alone(model: GPT, context: list[int], option: list[int]) -> float:
    """Mean loss of the option's tokens, one unpadded sequence."""
    ids = torch.tensor([context + option])
    y = torch.full_like(ids, -1)
    y[0, len(context) - 1 : -1] = ids[0, len(context) :]
    return float(model(ids, y, reduction="mean"))


def _items(model: GPT, pick) -> list[Choice]:
    rng = random.Random(3)
    items = []
    for i in range(30):  # contexts and options of different lengths, so rows are padded differently
        context = [rng.randrange(64) for _ in range(rng.randint(2, 12))]
        options = [[rng.randrange(64) for _ in range(rng.randint(1, 6))] for _ in range(4)]
        losses = [_alone(model, context, o) for o in options]
        items.append(Choice("t" + str(i % 2), context, options, int(pick(losses))))
    return items


def test_batched_multiple_choice_agrees_with_scoring_each_option_alone():
    model = _model()
    ts = SimpleNamespace(model=model)
    with torch.no_grad():
        best = _items(model, np.argmin)
        worst = _items(model, np.argmax)
    # batch_rows=7 splits items across batches: the padding and batch boundaries must not matter
    assert multiple_choice(ts, best, batch_rows=7) == {"t0": 1.0, "t1": 1.0, "overall": 1.0}
    assert multiple_choice(ts, worst, batch_rows=64) == {"t0": 0.0, "t1": 0.0, "overall": 0.0}


def test_mean_option_loss_ignores_the_padding_after_a_short_row():
    model = _model()
    with torch.no_grad():
        short = _alone(model, [1, 2, 3], [4])
        x = torch.tensor([[1, 2, 3, 4, 0, 0, 0, 0]])
        y = torch.full_like(x, -1)
        y[0, 2] = 4
        padded = float(model(x, y, reduction="none").sum())
    assert math.isclose(short, padded, rel_tol=1e-5)

"""The DPO stage's loss variants (dpo.loss: sigmoid, ipo, simpo, sft_dpo) against values worked out by
hand from TRL's formulas, on two pairs whose responses have different lengths (so the length-averaged
variants differ from the summed ones); SimPO needs no reference model; evaluation reports the stage's
own variant."""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from ghostvis_core.data.loader import Batch, Batcher, PreferenceRows
from ghostvis_core.data.shard_ref import ShardRef
from ghostvis_core.data.stream import SourceStream
from ghostvis_core.data.token_shard import list_column, write_token_shard
from ghostvis_core.errors import GhostvisError
from ghostvis_core.plan.batch import IGNORE_INDEX
from ghostvis_core.plan.config import DPOConfig, ModelConfig
from ghostvis_core.plan.presets import resolve
from ghostvis_core.run.model.gpt import GPT
from ghostvis_core.run.train.dist import DistContext
from ghostvis_core.run.train.objectives import DPOObjective

# rows: pair 0 chosen, rejected; pair 1 chosen, rejected
LENGTHS = [2, 4, 4, 1]  # response tokens per row
POLICY = [-2.0, -6.0, -6.0, -2.5]  # summed response log-probs
REFERENCE = [-3.0, -5.0, -4.4, -1.0]


class FixedLogprobs(torch.nn.Module):
    """A 'model' whose log p(target) is sums[r] / LENGTHS[r] on row r's response positions, 0 elsewhere
    (float64, so the 1e-6 checks test the formulas rather than float32 rounding)."""

    def __init__(self, sums: list[float]):
        super().__init__()
        self.lp = torch.zeros(4, 4, dtype=torch.float64)
        for r, (s, n) in enumerate(zip(sums, LENGTHS)):
            self.lp[r, :n] = s / n

    def forward(self, inputs, targets, reduction):
        assert reduction == "logprobs"
        return self.lp


def pairs_batch() -> Batch:
    targets = torch.full((4, 4), IGNORE_INDEX, dtype=torch.long)
    for r, n in enumerate(LENGTHS):
        targets[r, :n] = 1
    return Batch(torch.zeros(4, 4, dtype=torch.long), targets, [], 16, 0, 11)


def objective(ref: torch.nn.Module | None, **dpo) -> DPOObjective:
    obj = DPOObjective.__new__(DPOObjective)  # the loss needs the DPO config and the reference, not shards
    obj.dpo, obj.ref = DPOConfig(**dpo), ref
    return obj


def loss(**dpo) -> float:
    obj = objective(FixedLogprobs(REFERENCE), **dpo)
    return float(obj.loss_sum(FixedLogprobs(POLICY), pairs_batch(), "cpu"))


def test_sigmoid_is_the_default_and_matches_dpo_by_hand():
    assert DPOConfig().loss == "sigmoid"
    # pair 0: 0.1 x ((-2 - -3) - (-6 - -5)) = 0.1 x (1 + 1) = 0.2      -> -log sigmoid(0.2) = 0.5981389
    # pair 1: 0.1 x ((-6 - -4.4) - (-2.5 - -1)) = 0.1 x (-1.6 + 1.5) = -0.01 -> -log sigmoid(-0.01) = 0.6981597
    assert loss() == pytest.approx(0.5981389 + 0.6981597, abs=1e-6)


def test_ipo_by_hand():
    # length-averaged log-ratios: pair 0: (-2 - -3)/2 - (-6 - -5)/4 = 0.5 + 0.25 = 0.75
    #                             pair 1: (-6 - -4.4)/4 - (-2.5 - -1)/1 = -0.4 + 1.5 = 1.1
    # beta 0.1: target 1/(2 x 0.1) = 5 -> (0.75 - 5)^2 + (1.1 - 5)^2 = 18.0625 + 15.21
    assert loss(loss="ipo", beta=0.1) == pytest.approx(18.0625 + 15.21, abs=1e-6)
    # beta 0.5: target 1 -> (0.75 - 1)^2 + (1.1 - 1)^2 = 0.0625 + 0.01
    assert loss(loss="ipo", beta=0.5) == pytest.approx(0.0625 + 0.01, abs=1e-6)


def test_simpo_by_hand_without_a_reference():
    # average log-probs: pair 0: -2/2 = -1, -6/4 = -1.5; pair 1: -6/4 = -1.5, -2.5/1 = -2.5
    # beta 2, gamma 0.5: pair 0: 2 x (-1 + 1.5) - 0.5 = 0.5 -> -log sigmoid(0.5) = 0.4740770
    #                    pair 1: 2 x (-1.5 + 2.5) - 0.5 = 1.5 -> -log sigmoid(1.5) = 0.2014133
    obj = objective(None, loss="simpo", beta=2.0, gamma=0.5)  # no reference: never called
    value = float(obj.loss_sum(FixedLogprobs(POLICY), pairs_batch(), "cpu"))
    assert value == pytest.approx(0.4740770 + 0.2014133, abs=1e-6)
    # gamma is the full margin: at gamma 0 the pairs are -log sigmoid(1) and -log sigmoid(2)
    obj.dpo = dataclasses.replace(obj.dpo, gamma=0.0)
    assert float(obj.loss_sum(FixedLogprobs(POLICY), pairs_batch(), "cpu")) == pytest.approx(
        0.3132617 + 0.1269280, abs=1e-6
    )


def test_sft_dpo_adds_the_chosen_responses_mean_nll():
    # the sigmoid losses (0.5981389, 0.6981597) + alpha x (-average chosen log-prob):
    # pair 0: 0.5 x 2/2 = 0.5; pair 1: 0.5 x 6/4 = 0.75
    assert loss(loss="sft_dpo", alpha=0.5) == pytest.approx(0.5981389 + 0.6981597 + 0.5 + 0.75, abs=1e-6)
    assert loss(loss="sft_dpo", alpha=0.0) == pytest.approx(loss(), abs=1e-12)


def test_simpo_builds_no_reference_model_and_dpo_does():
    torch.manual_seed(0)
    model = GPT(
        ModelConfig(vocab_size=16, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=64, max_seq_len=16)
    )
    obj = objective(None, loss="simpo")
    obj.prepare_model(model)  # would read the upstream checkpoint from the store if it built a reference
    assert obj.ref is None and not obj.uses_reference
    assert all(objective(None, loss=name).uses_reference for name in ("sigmoid", "ipo", "sft_dpo"))


def test_an_unknown_loss_is_refused_naming_the_choices():
    with pytest.raises(
        GhostvisError, match=r"dpo.loss: 'kto' is not one of sigmoid, ipo, simpo, sft_dpo.*--set dpo.loss="
    ):
        resolve("dpo", "tiny", {"dpo.loss": "kto"})  # refused when the config is resolved, before any launch


def _prefs_shard(tmp_path: Path) -> SourceStream:
    """Two pairs: prompt [5, 6], chosen [7, 8] / rejected [9]; prompt [4], chosen [10] / rejected [11, 12, 13]."""
    path = tmp_path / "prefs" / "p.arrow"
    write_token_shard(
        path,
        {
            "row": pa.array([0, 1], pa.int64()),
            "tokens": list_column([5, 5], [5, 6, 7, 8, 9, 4, 10, 11, 12, 13], np.uint16),
            "prompt_len": pa.array([2, 1], pa.int64()),
            "chosen_len": pa.array([2, 1], pa.int64()),
        },
    )
    return SourceStream("prefs", [ShardRef("prefs/00000", "prefs", "validation", str(path), docs=2, tokens=10)], 0)


@pytest.mark.parametrize("variant", ["sigmoid", "ipo", "simpo", "sft_dpo"])
def test_evaluation_reports_the_stages_own_variant(tmp_path, variant):
    cfg = resolve("dpo", "tiny", {"dpo.loss": variant, "batch.micro_batch_size": 4})
    torch.manual_seed(0)
    mcfg = ModelConfig(vocab_size=16, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=64, max_seq_len=16)
    policy, reference = GPT(mcfg).eval(), GPT(mcfg).eval()  # two seeds' draws: the margins are not 0
    obj = objective(reference if variant != "simpo" else None, loss=variant)
    obj.cfg, obj.seq_len = cfg, 8
    rows = PreferenceRows(_prefs_shard(tmp_path), seq_len=8, seed=0, pad_id=0)
    obj.val_streams, obj.val_rows = {"prefs": None}, lambda src: (rows, 4)
    out = obj.evaluate(policy, DistContext(0, 0, 1, torch.device("cpu")), nullcontext, evidence=True)
    batch = Batcher([rows], [1.0]).batch([0, 1, 2, 3])
    with torch.no_grad():
        losses, chosen, rejected = obj.pair_losses(obj.scores(policy, batch, "cpu"))
    assert out["val/loss"] == out["val/loss/prefs"] == pytest.approx(float(losses.mean()), abs=1e-6)
    assert out["evidence/reward_margin"] == pytest.approx(float((chosen - rejected).mean()), abs=1e-6)
    assert out["evidence/preference_accuracy"] == float((chosen > rejected).float().mean())

"""TokenCounts: the four figures as one type, and the typed records saved with runs."""

from __future__ import annotations

import torch

from ghostvis_core.counts import TokenCounts
from ghostvis_core.data.loader import LoaderPosition
from ghostvis_core.plan.batch import BatchPlan
from ghostvis_core.plan.budget import plan
from ghostvis_core.plan.presets import resolve
from ghostvis_core.run.train.state import TrainState
from ghostvis_core.runs.launch_spec import LaunchSpec, StageInputs
from ghostvis_core.runs.run_result import BeforeAfter, FrozenCheck, MixtureShare, RunResult
from tests.launch_records import launch_record


def test_arithmetic_and_names():
    a, b = TokenCounts(10, 2, 7, 1), TokenCounts(5, 0, 5, 3)
    assert a + b == TokenCounts(15, 2, 12, 4) == TokenCounts.total([a, b])
    assert TokenCounts.names() == ("real_tokens", "pad_tokens", "loss_tokens", "cropped_tokens")
    assert TokenCounts.from_list([15.0, 2.0, 12.0, 4.0]) == a + b
    assert TokenCounts.from_mapping(
        {"real_tokens": 1, "pad_tokens": 2, "loss_tokens": 3, "cropped_tokens": 4, "steps": 9}
    ).as_list() == [1, 2, 3, 4]
    assert a.as_metrics() == {"tokens/real": 10, "tokens/pad": 2, "tokens/loss": 7, "tokens/cropped": 1}
    assert a.consumed == 12 and TokenCounts.total([]) == TokenCounts()


def test_run_result_round_trips_through_its_dict():
    r = RunResult(
        run_key="sft-x-r1",
        stage="sft",
        steps=8,
        segment=1,
        counts=TokenCounts(4096, 100, 900, 7),
        planned_tokens=4196,
        batch=BatchPlan(8, 256, 2, 1),
        train_loss=1.5,
        val_loss=1.4,
        val_loss_start=6.7,
        tokens_per_sec=1e4,
        first_step_s=3.2,
        wall_time_s=30.0,
        checkpoint_uri="/s/checkpoints/sft/sft-x-r1/step_000000008",
        parent_run_key="va-r1",
        mlflow_run_id="abc",
        mlflow_experiment_id="1",
        evidence={"eot_rate": BeforeAfter(0.0, 0.9)},
        mixture={"chat": MixtureShare(1.0, 1.0, 4000)},
        frozen=FrozenCheck("aa", "aa"),
    )
    back = RunResult.from_dict(r.to_dict())
    assert back == r and back.frozen.unchanged and back.counts.loss_tokens == 900
    # the record keeps the derived tokens_per_step for readers of the JSON; reading it back derives it again
    assert r.to_dict()["batch"] == {
        "micro_batch_size": 8,
        "seq_len": 256,
        "world_size": 2,
        "grad_accum_steps": 1,
        "tokens_per_step": 4096,
    }
    assert back.batch.tokens_per_step == 4096


def test_launch_spec_and_train_state_round_trip_with_their_typed_parts():
    inputs = StageInputs(
        stream_offsets={"web": 512},
        old_seq_len=256,
        upstream_rope_base=1e4,
        upstream_rope_scaling=1.0,
    )
    cfg = resolve("pretrain", "smoke")
    spec = launch_record("pretrain", "k", cfg, plan(cfg), inputs=inputs)
    import json

    assert LaunchSpec.from_dict(json.loads(spec.to_json())) == spec
    state = TrainState(
        "k",
        4096,
        2,
        step=3,
        loader=LoaderPosition(48),
        counts=TokenCounts(1, 2, 3, 4),
        val_start={"val/loss": 4.5},
        val_last={"val/loss": 3.25},
    )
    torch.manual_seed(7)
    state.capture_rng()
    expected = torch.rand(3)
    saved = json.loads(json.dumps(state.to_dict()))
    assert saved["rows"] == 48 and saved["history"] == {"val_start": {"val/loss": 4.5}, "val_last": {"val/loss": 3.25}}
    restored = TrainState.from_dict(saved)
    torch.manual_seed(99)
    restored.restore_rng()
    assert torch.equal(torch.rand(3), expected) and restored == state

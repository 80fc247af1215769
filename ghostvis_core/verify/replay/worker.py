"""One interval replayed in this process: the starting point (the checkpoint before the interval, or the run's
starting weights), the interval's optimizer steps on the ledger's recorded rows, and the comparison with the
checkpoint after it. Run as `python -m ghostvis_core.verify.replay.worker STORE STAGE RUN_KEY FIRST LAST`;
it prints its result as one JSON line.

One intra-op thread, as each torchrun rank trains (OMP_NUM_THREADS=1): a CPU kernel's summation order may
follow its thread count, and the replay must add in the ranks' order to be bitwise."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ghostvis_core.data.ledger import Ledger
from ghostvis_core.errors import GhostvisError
from ghostvis_core.run.train import checkpoint as ckpt
from ghostvis_core.run.train.dist import DistContext
from ghostvis_core.run.train.precision import use_bf16
from ghostvis_core.run.train.setup import build_model, make_optimizer
from ghostvis_core.run.train.state import TrainState
from ghostvis_core.runs.launch_spec import LaunchSpec
from ghostvis_core.runs.lookup import checkpoint_of
from ghostvis_core.store import Store, open_store
from ghostvis_core.store.layout import step_dir_name
from ghostvis_core.verify.replay.batches import ReplayRows
from ghostvis_core.verify.replay.compare import compare_with, trained_parameters
from ghostvis_core.verify.replay.intervals import Interval
from ghostvis_core.verify.replay.steps import replay_step

CPU = DistContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def checkpoint_at(store: Store, spec: LaunchSpec, step: int) -> Path:
    return store.fetch("checkpoint", spec.stage, spec.run_key, step_dir_name(step))


def starting_point(store: Store, spec: LaunchSpec, interval: Interval, trained: set[str]):
    """The model and optimizer the interval starts from, built as the trainer builds them (setup.py): the
    seeded model, then the checkpoint before the interval (weights, optimizer state, RNG), or for the first
    interval the run's starting weights (the stage's initial checkpoint, if any) and a fresh optimizer."""
    cfg = spec.config
    torch.manual_seed(cfg.data.seed)
    model = build_model(cfg, CPU)
    before = checkpoint_at(store, spec, interval.first - 1) if interval.first > 1 else None
    if before is not None:
        ckpt.load_model(before, model)
    elif spec.init_checkpoint:
        start = checkpoint_of(store, spec.init_checkpoint)
        ckpt.load_model(start, model, allow_missing=("vision.",) if spec.inputs.new_vision else ())
    for name, p in model.named_parameters():
        p.requires_grad_(name in trained)
    optimizer = make_optimizer(model, cfg, CPU.device)
    if before is not None:
        ckpt.load_optimizer(before, model, optimizer)
        TrainState.from_dict(ckpt.read_state(before)).restore_rng()
    return model, optimizer


def replay_interval(store: Store, stage: str, run_key: str, interval: Interval) -> dict[str, Any]:
    """The interval's replay and its comparison with the checkpoint after it, as a dict."""
    torch.set_num_threads(1)
    spec = LaunchSpec.read(store, stage, run_key)
    after = checkpoint_at(store, spec, interval.last)
    model, optimizer = starting_point(store, spec, interval, trained_parameters(after))
    rows = ReplayRows(store, spec.to_dict())
    ledger = Ledger.in_store(store)
    feeds = {(f.step, f.rank): f for f in ledger.feeds(ledger.chain(run_key))}
    world = TrainState.from_dict(ckpt.read_state(after)).world_size
    bf16 = use_bf16(spec.config.runtime.precision, CPU.device)

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)

    model.train()
    build_s = step_s = 0.0
    for step in range(interval.first, interval.last + 1):
        started = time.perf_counter()
        ranks = rows.step(feeds, step, world)
        built = time.perf_counter()
        replay_step(model, optimizer, ranks, (step, spec.plan.steps, spec.config), autocast)
        build_s, step_s = build_s + built - started, step_s + time.perf_counter() - built
    comparison = compare_with(after, model, optimizer)
    return {
        "first": interval.first,
        "last": interval.last,
        "world_size": world,
        "bf16": bf16,
        "batch_build_s": round(build_s, 3),
        "steps_s": round(step_s, 3),
        **comparison,
    }


def main(argv: list[str]) -> int:
    store_uri, stage, run_key, first, last = argv
    try:
        result = replay_interval(open_store(store_uri), stage, run_key, Interval(int(first), int(last)))
    except GhostvisError as exc:
        result = {"first": int(first), "last": int(last), "error": str(exc)}
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The content proof's cost: the share of a training step spent digesting what the model is fed.

The real training step (`ghostvis_core.run.train.trainer.Trainer.train_step`, world size 1, the demo's `tiny` pretrain
shape, the precision `auto` picks) runs --steps times after a warm-up step; every call of the digest is timed
inside the step: `FedLog.received` (the model's forward pre-hook, once per micro-batch: the input tensors held on
the host) and `FedLog.settle` (once per step, after its one host read: the digests).
Goal: digest time / step time < 2%.

    .venv/bin/python benchmarks/content_digest.py [--home PATH] [--steps 20]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

GOAL_SHARE = 0.02


def measure(home: Path, steps: int) -> dict:
    import torch

    from ghostvis_core.home import Home
    from ghostvis_core.launch.start import prepare_run
    from ghostvis_core.run.train.dist import DistContext
    from ghostvis_core.run.train.feeds import FedLog
    from ghostvis_core.run.train.setup import setup

    spec = prepare_run(
        "pretrain",
        preset="tiny",
        home=Home(home),
        overrides={"batch.world_size": 1, "budget.steps": steps + 1, "data.seed": 97},
    )
    trainer = setup(spec, DistContext(0, 0, 1, torch.device("cpu")))
    spent = [0.0]
    originals = {name: getattr(FedLog, name) for name in ("received", "settle")}

    def timed(original):
        def call(*args):
            t0 = time.perf_counter()
            original(*args)
            spent[0] += time.perf_counter() - t0

        return call

    for name, original in originals.items():
        setattr(FedLog, name, timed(original))
    try:
        trainer.train_step()  # warm-up: allocator and threads
        spent[0], t0 = 0.0, time.perf_counter()
        for _ in range(steps):
            trainer.train_step()
        wall = time.perf_counter() - t0
    finally:
        for name, original in originals.items():  # nothing was logged: the trainer made no MLflow run (tracking.py)
            setattr(FedLog, name, original)
    p = trainer.plan
    return {
        "steps": steps,
        "step_s": wall / steps,
        "digest_s": spent[0] / steps,
        "share": spent[0] / wall,
        "shape": f"{p.micro_batch_size}x{p.seq_len}x{p.world_size}x{p.grad_accum_steps}",
        "bf16": trainer.bf16,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--home", help="a GhostVis home with tokenized data (default: build a smoke demo home)")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    with C.work_folder("digest") as wd:
        src, how = C.home_arg_or_build(args.home, wd)
        r = measure(C.scratch_home(src, wd / "home"), args.steps)
    print(f"home: {how}\nshape (micro x seq x world x accum): {r['shape']}, bf16={r['bf16']}")
    print(
        C.table(
            [[r["steps"], r["step_s"] * 1000, r["digest_s"] * 1000, 100 * r["share"]]],
            ["steps", "step ms", "digest ms", "digest % of step"],
        )
    )
    print(C.goal("digest share of step time", r["share"], GOAL_SHARE, higher_is_better=False))
    print(C.kv_line({k: v for k, v in r.items() if k != "shape"}))
    return 0


if __name__ == "__main__":
    C.main_wrapper(main)

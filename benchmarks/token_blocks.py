"""The cost of verifying token files as they are read: the share of a training step spent checking token blocks.

The real training step (`ghostvis_core.run.train.trainer.Trainer.train_step`, world size 1, the demo's `tiny`
pretrain shape, the precision `auto` picks) runs --steps times after a warm-up step; every call of the block
check (`BlockCheck.cover`, from `TokenShard.slice` as the loader reads tokens: a block's sha256 the first time
it is read, a set lookup after) is timed inside the step, and every block's hash (warm-up step included).
A block is hashed once per open file, so a run pays each token's share of its block's hash once: reported as
the amortized share (hash time per token x tokens per step / step time), beside the share of the one step that
first reads a block (a whole block's hash). Goals: measured check time and amortized hashing <= 1% of step time.

    .venv/bin/python benchmarks/token_blocks.py [--home PATH] [--steps 40]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

GOAL_SHARE = 0.01


def measure(home: Path, steps: int) -> dict:
    import torch

    from ghostvis_core.data import token_blocks
    from ghostvis_core.home import Home
    from ghostvis_core.launch.start import prepare_run
    from ghostvis_core.run.train.dist import DistContext
    from ghostvis_core.run.train.setup import setup

    spec = prepare_run(
        "pretrain",
        preset="tiny",
        home=Home(home),
        overrides={"batch.world_size": 1, "budget.steps": steps + 1, "data.seed": 97},
    )
    trainer = setup(spec, DistContext(0, 0, 1, torch.device("cpu")))
    spent, hashes = [0.0], []
    cover, sha = token_blocks.BlockCheck.cover, token_blocks.block_sha256

    def timed_cover(self, tokens, start, end):
        t0 = time.perf_counter()
        cover(self, tokens, start, end)
        spent[0] += time.perf_counter() - t0

    def timed_sha(block):
        t0 = time.perf_counter()
        digest = sha(block)
        hashes.append((len(block), time.perf_counter() - t0))
        return digest

    token_blocks.BlockCheck.cover, token_blocks.block_sha256 = timed_cover, timed_sha
    try:
        trainer.train_step()  # warm-up: allocator and threads; the first blocks of each source are hashed here
        spent[0], t0 = 0.0, time.perf_counter()
        for _ in range(steps):
            trainer.train_step()
        wall = time.perf_counter() - t0
    finally:
        token_blocks.BlockCheck.cover, token_blocks.block_sha256 = cover, sha  # nothing was logged: no MLflow run
    p = trainer.plan
    per_token = sum(s for _, s in hashes) / sum(n for n, _ in hashes)
    return {
        "steps": steps,
        "step_s": wall / steps,
        "check_s": spent[0] / steps,
        "share": spent[0] / wall,
        "blocks_hashed": len(hashes),
        "block_hash_s": per_token * token_blocks.BLOCK_TOKENS,
        "amortized_share": per_token * p.tokens_per_step / (wall / steps),
        "first_read_share": per_token * token_blocks.BLOCK_TOKENS / (wall / steps),
        "tokens_per_step": p.tokens_per_step,
        "shape": f"{p.micro_batch_size}x{p.seq_len}x{p.world_size}x{p.grad_accum_steps}",
        "bf16": trainer.bf16,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--home", help="a GhostVis home with tokenized data (default: build a smoke demo home)")
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    with C.work_folder("token-blocks") as wd:
        src, how = C.home_arg_or_build(args.home, wd)
        r = measure(C.scratch_home(src, wd / "home"), args.steps)
    print(f"home: {how}\nshape (micro x seq x world x accum): {r['shape']}, bf16={r['bf16']}")
    print(
        C.table(
            [[r["steps"], r["tokens_per_step"], r["step_s"] * 1000, r["check_s"] * 1000, 100 * r["share"]]],
            ["steps", "tokens/step", "step ms", "check ms", "check % of step"],
        )
    )
    print(
        f"{r['blocks_hashed']} blocks hashed, {r['block_hash_s'] * 1000:.3f} ms a block: every token's block is "
        f"hashed once, {100 * r['amortized_share']:.4f}% of a step amortized; the one step that first reads a "
        f"block pays {100 * r['first_read_share']:.3f}% of its time"
    )
    print(C.goal("block check share of step time", r["share"], GOAL_SHARE, higher_is_better=False))
    print(
        C.goal("amortized block hashing share of step time", r["amortized_share"], GOAL_SHARE, higher_is_better=False)
    )
    print(C.kv_line({k: v for k, v in r.items() if k != "shape"}))
    return 0


if __name__ == "__main__":
    C.main_wrapper(main)

"""Two gloo ranks on the CPU for the tests of FSDP2, DCP checkpoints and Muon (test_fsdp, test_muon):
a tiny GPT, the trainer's step over a fixed global batch, forked rank processes, and the step-3
checkpoint both files resume from, so that each test file keeps only what it checks.

torch's FSDP, DCP and dynamo modules are imported here, before any fork: loaded lazily they cost
seconds per rank.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch._dynamo  # noqa: F401  (imported before forking: FSDP and DCP load these lazily, seconds per rank)
import torch.distributed as dist
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import torch.multiprocessing as mp

from ghostvis_core.plan.config import ModelConfig
from ghostvis_core.run.model.gpt import GPT
from ghostvis_core.run.train import checkpoint as ckpt
from ghostvis_core.run.train.dist import DistContext
from ghostvis_core.run.train.parallel import wrap
from tests.conftest import free_port

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=16)
ROWS_PER_STEP = 8  # global rows per optimizer step: micro 2 x world 2 x accum 2, or micro 2 x world 1 x accum 4
MICRO = 2
SAVED_STEP = 3  # the step of the checkpoint `write_then_continue` writes

Optimizer = Callable[[torch.nn.Module], torch.optim.Optimizer]


def _rows(step: int) -> torch.Tensor:
    """The global batch of a step: ROWS_PER_STEP rows of 9 tokens, the same whatever the world size."""
    g = torch.Generator().manual_seed(1000 + step % 2)  # two batches, seen again and again: it must learn them
    return torch.randint(0, CFG.vocab_size, (ROWS_PER_STEP, 9), generator=g)


def train_steps(par, opt, steps: range, rank: int, world: int) -> list[float]:
    """The trainer's step: micro-batches interleaved over ranks, loss normalised over the whole step."""
    losses = []
    accum = ROWS_PER_STEP // (MICRO * world)
    for step in steps:
        rows = _rows(step)
        total = torch.zeros(())
        for m in range(accum):
            start = (m * world + rank) * MICRO
            x = rows[start : start + MICRO]
            with par.accumulating(last_micro_step=m == accum - 1):
                loss = par.forward_module(x[:, :-1], x[:, 1:], reduction="sum")
                (loss * world / (ROWS_PER_STEP * 8)).backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(par.model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if world > 1:
            dist.all_reduce(total)
        losses.append(float(total) / (ROWS_PER_STEP * 8))
    return losses


def _worker(rank: int, world: int, port: int, fn, queue, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        queue.put((rank, fn(rank, world, *args)))
    finally:
        dist.destroy_process_group()


def spawn(fn, *args, world: int = 2) -> list:
    """Run fn(rank, world, *args) on `world` gloo ranks; the results by rank."""
    ctx = mp.get_context("fork")  # no re-import per rank: seconds, not tens of seconds
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, queue, args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0, f"rank process exited with {p.exitcode}"
    out = dict(queue.get() for _ in procs)
    return [out[r] for r in range(world)]


def commit(run_dir: Path, par, opt, extra_dirs: dict) -> Path:
    """Rank 0's commit of the step-3 checkpoint (weights, optimizer, data position, the ranks' shards)."""
    return ckpt.save(
        run_dir,
        SAVED_STEP,
        model=par.model,
        optimizer=opt,
        state={"step": SAVED_STEP, "rows": SAVED_STEP * ROWS_PER_STEP},
        config={},
        extra_dirs=extra_dirs,
    )


def write_then_continue(par, opt, rank: int, world: int, run_dir: str, shards: bool) -> list[float]:
    """3 steps, a checkpoint the way commit.py writes it (DCP shards when `shards`), 3 more steps: the
    losses of the steps after the checkpoint, which a resume must give again."""
    train_steps(par, opt, range(SAVED_STEP), rank, world)
    extra = ckpt.save_shards(Path(run_dir), SAVED_STEP, par.model, opt) if shards else {}
    if rank == 0:
        commit(Path(run_dir), par, opt, extra)
    dist.barrier()
    return train_steps(par, opt, range(SAVED_STEP, 6), rank, world)


def resumed(path: str, rank: int, world: int, strategy: str, optimizer: Optimizer):
    """The model and optimizer of the checkpoint at `path`, wrapped for `strategy`, from other weights
    than the run's (seed 1): everything must come from the checkpoint."""
    torch.manual_seed(1)
    model = GPT(CFG)
    ckpt.load_model(Path(path), model)
    par = wrap(model, DistContext(rank, rank, world, torch.device("cpu")), strategy)
    opt = optimizer(par.model)
    ckpt.load_optimizer(Path(path), par.model, opt)
    return par, opt

"""The bare PyTorch loop that trainer_throughput.py compares the trainer against (run under torchrun).

Same model (ghostvis_core.run.model.gpt.GPT built from the resolved stage config's ModelConfig), DDP,
AdamW with the trainer's hyperparameters and parameter groups (decay on >= 2-D parameters), the
same micro-batch shape and grad accumulation, random token batches generated before the loop,
bf16 autocast (or fp32), grad-norm clipping. Nothing else: no data loader, no token accounting, no
logging, no extra collectives. On CUDA (NCCL, the batches on the GPU before the loop) each step ends
with one synchronize, as the trainer's ends with its one host read.

Timing is the trainer's: tokens/s counts from the end of step 1 to the end of the last step (rank 0).

    torchrun --standalone --nproc_per_node=2 benchmarks/_bare_loop.py --spec <spec.json> --steps 50 --precision bf16
"""

from __future__ import annotations

import time

T_START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from ghostvis_core.plan.config import ModelConfig  # noqa: E402
from ghostvis_core.run.model.gpt import GPT  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True, help="a LaunchSpec (spec.json) whose config to reproduce")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    args = ap.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if cuda:
        torch.cuda.set_device(dev)
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo")

    cfg = json.loads(open(args.spec).read())["config"]
    b, o = cfg["batch"], cfg["optim"]
    mbs, seq, accum = b["micro_batch_size"], b["seq_len"], b.get("grad_accum_steps") or 1
    torch.manual_seed(cfg["data"]["seed"])
    model = GPT(ModelConfig(**cfg["model"])).to(dev)
    ddp = DDP(model) if world > 1 else model
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": o["weight_decay"]},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=o["lr"],
        betas=(o["beta1"], o["beta2"]),
    )
    bf16 = args.precision == "bf16"

    gen = torch.Generator().manual_seed(1000 + rank)
    data = torch.randint(0, model.cfg.vocab_size, (args.steps, accum, mbs, seq + 1), generator=gen)
    batches = [
        [(data[s, m, :, :-1].contiguous().to(dev), data[s, m, :, 1:].contiguous().to(dev)) for m in range(accum)]
        for s in range(args.steps)
    ]
    del data
    tokens_per_step = mbs * seq * world * accum

    ends = []
    t_loop0 = time.time()
    for s in range(args.steps):
        for m, (x, y) in enumerate(batches[s]):
            last = m == accum - 1
            ctx = ddp.no_sync() if (world > 1 and not last) else _null()
            with ctx:
                with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
                    loss = ddp(x, y) / accum
                loss.backward()
        if o["grad_clip"] > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), o["grad_clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        ends.append(time.time())
        if s == 0 and rank == 0:
            print("BARE_STEP1", flush=True)  # the launcher time-stamps this line (launch -> first step)

    if rank == 0:
        n = len(ends)
        half = max(1, n // 2)
        result = {
            "steps": n,
            "precision": args.precision,
            "tokens_per_step": tokens_per_step,
            "micro_batch_size": mbs,
            "seq_len": seq,
            "world_size": world,
            "grad_accum_steps": accum,
            "tokens_per_sec": (n - 1) * tokens_per_step / (ends[-1] - ends[0]) if n > 1 else 0.0,
            # the same late window trainer_throughput takes from the trainer's log (step ~n/2 to n)
            "late_window": [half, n],
            "tokens_per_sec_late": (n - half) * tokens_per_step / (ends[-1] - ends[half - 1]) if n > half else 0.0,
            "first_step_s_from_loop": ends[0] - t_loop0,
            "first_step_s_from_process_start": ends[0] - T_START,
            "step_s": [round(b - a, 4) for a, b in zip(ends, ends[1:])],
        }
        print("BARE_RESULT " + json.dumps(result), flush=True)
    if world > 1:
        dist.destroy_process_group()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()

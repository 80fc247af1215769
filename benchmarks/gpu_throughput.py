"""GPU throughput: tokens/s, MFU and peak memory of the trainer's model step on the CUDA devices present.

Cases: 500m with ddp and with fsdp, 1.5b with fsdp (the presets' pretrain model, micro batch and
seq_len; bf16 where the GPU has it; torch.compile per block; activation checkpointing as the preset
sets it). Each case runs under `torchrun --standalone --nproc_per_node=<GPUs>` with this file as
the worker: the GPT, `parallel.wrap` (the trainer's DDP / FSDP2 strategies), AdamW, gradient
clipping and the chunked loss, on random tokens; tokens/s over the timed steps after the warm-up,
MFU from `train/efficiency.py` (the GPU table's bf16 peak), peak memory from
torch.cuda.max_memory_allocated. Goal: 500m at MFU >= 0.45 on one H100-class GPU.

Each case also runs with `runtime.float8` (the trainer's `train/float8.py` conversion of the decoder's
Linear layers to torchao float8 matmuls) where the GPU has float8 tensor cores (compute capability
>= 8.9) and torchao is installed: bf16 and float8 tokens/s side by side, with the float8 speed-up
(torchtitan and nanochat publish +17% to +28% on H100s). MFU is against the bf16 peak, so it is
shown for bf16 only.

Without a CUDA device it says so and exits 0.

    .venv/bin/python benchmarks/gpu_throughput.py [--steps 20] [--warmup 5]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

GOAL_MFU_500M = 0.45
CASES = [("500m", "ddp"), ("500m", "fsdp"), ("1.5b", "fsdp")]


def document_ids(b: int, t: int, generator) -> torch.Tensor:
    """Rows packed with documents of random lengths (16 to t/2 positions), the way the loader packs."""
    rows = []
    for _ in range(b):
        lengths, n = [], 0
        while n < t:
            lengths.append(min(t - n, int(torch.randint(16, t // 2, (1,), generator=generator))))
            n += lengths[-1]
        rows.append(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)))
    return torch.stack(rows)


def worker(preset: str, strategy: str, steps: int, warmup: int, out: Path, use_float8: bool, packed: bool) -> None:
    """One rank: the trainer's model step on random tokens; rank 0 writes the figures as JSON. `packed`:
    rows of packed documents, each step's own, so attention keeps within documents as in training."""
    from ghostvis_core.plan import presets
    from ghostvis_core.run.model.gpt import GPT
    from ghostvis_core.run.train import dist, float8
    from ghostvis_core.run.train.efficiency import efficiency
    from ghostvis_core.run.train.parallel import wrap
    from ghostvis_core.run.train.precision import use_bf16

    ctx = dist.setup()
    cfg = presets.resolve("pretrain", preset, {"parallel.strategy": strategy, "batch.world_size": ctx.world_size})
    bf16 = use_bf16(cfg.runtime.precision, ctx.device)
    model = GPT(cfg.model).to(ctx.device)
    model.grad_checkpointing = cfg.runtime.grad_checkpointing
    if use_float8:  # as the trainer does it: before compile and the parallel wrapper
        float8.convert(model)
    model.compile_blocks()
    par = wrap(model, ctx, strategy, bf16)
    opt = torch.optim.AdamW(par.model.parameters(), lr=1e-4, fused=True)
    b = cfg.batch
    x = torch.randint(0, cfg.model.vocab_size, (b.micro_batch_size, b.seq_len + 1), device=ctx.device)
    g = torch.Generator().manual_seed(0)
    docs = [document_ids(b.micro_batch_size, b.seq_len, g).to(ctx.device) for _ in range(4)] if packed else [None]
    for i in range(warmup + steps):
        if i == warmup:
            torch.cuda.synchronize()
            start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            par.forward_module(x[:, :-1], x[:, 1:], doc_ids=docs[i % len(docs)]).backward()
        torch.nn.utils.clip_grad_norm_(par.model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    tok_s = steps * b.micro_batch_size * b.seq_len * ctx.world_size / (time.perf_counter() - start)
    e = efficiency(cfg, ctx.device, bf16, ctx.world_size)
    if ctx.is_main:
        out.write_text(
            json.dumps(
                {
                    "tokens_per_sec": tok_s,
                    "mfu": e.mfu(tok_s),
                    "peak_source": e.peak_source,
                    "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9,
                    "gpus": ctx.world_size,
                    "micro_batch": f"{b.micro_batch_size} x {b.seq_len}",
                }
            )
        )


def run_case(
    preset: str, strategy: str, steps: int, warmup: int, use_float8: bool = False, packed: bool = False
) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = (
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={torch.cuda.device_count()}",
                __file__,
                "--worker",
                preset,
                strategy,
                "--steps",
                str(steps),
                "--warmup",
                str(warmup),
                "--out",
                str(out),
            ]
            + (["--float8"] if use_float8 else [])
            + (["--packed"] if packed else [])
        )
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
        if proc.returncode != 0 or not out.exists():
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            return {"error": "out of memory" if "OutOfMemoryError" in proc.stderr else last}
        return json.loads(out.read_text())


def float8_unavailable() -> str | None:
    """Why float8 cannot be measured here (the trainer's own refusal), or None."""
    from ghostvis_core.errors import GhostvisError
    from ghostvis_core.run.train.float8 import require_float8

    try:
        require_float8(torch.device("cuda", 0))
    except GhostvisError as exc:
        return str(exc).split(";")[0]
    return None


def float8_cell(bf16: dict, f8: dict | None) -> str:
    if f8 is None or "error" in f8:
        return f"{'-':>12} {'':>8} {'':>8}" + (f"  float8 failed: {f8['error']}" if f8 else "")
    return (
        f"{f8['tokens_per_sec']:>12,.0f} {f8['tokens_per_sec'] / bf16['tokens_per_sec']:>7.2f}x "
        f"{f8['peak_memory_gb']:>8.1f}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="timed optimizer steps per case")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation, allocator)")
    ap.add_argument("--worker", nargs=2, metavar=("PRESET", "STRATEGY"), help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--float8", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--packed", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(*args.worker, args.steps, args.warmup, args.out, args.float8, args.packed)
        return 0
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (run this on a GPU machine)")
        return 0
    print(f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
    no_float8 = float8_unavailable()
    if no_float8:
        print(f"float8 not measured: {no_float8}")
    print(
        f"{'preset':<6} {'strategy':<8} {'micro batch':>12} {'bf16 tok/s':>12} {'MFU':>6} {'peak GB':>8} "
        f"{'float8 tok/s':>12} {'speed-up':>8} {'peak GB':>8}"
    )
    results, speedups = {}, {}
    for preset, strategy in CASES:
        r = results[f"{preset}_{strategy}"] = run_case(preset, strategy, args.steps, args.warmup)
        if "error" in r:
            print(f"{preset:<6} {strategy:<8} {'':>12} failed: {r['error']}")
            continue
        f8 = None if no_float8 else run_case(preset, strategy, args.steps, args.warmup, use_float8=True)
        if f8 is not None and "error" not in f8:
            speedups[f"{preset}_{strategy}"] = f8["tokens_per_sec"] / r["tokens_per_sec"]
        print(
            f"{preset:<6} {strategy:<8} {r['micro_batch']:>12} {r['tokens_per_sec']:>12,.0f} {r['mfu']:>6.1%} "
            f"{r['peak_memory_gb']:>8.1f} {float8_cell(r, f8)}"
        )
    best = max((r.get("mfu", 0.0) for k, r in results.items() if k.startswith("500m")), default=0.0)
    print(f"goal {'met' if best >= GOAL_MFU_500M else 'missed'}: 500m MFU {best:.1%} (goal >= {GOAL_MFU_500M:.0%})")
    print(
        " ".join(
            [f"{k}_mfu={r.get('mfu', float('nan')):.4f}" for k, r in results.items()]
            + [f"{k}_float8_speedup={v:.3f}" for k, v in speedups.items()]
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

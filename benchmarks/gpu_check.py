"""The GPU check: one call that measures GhostVis's CUDA path on one GPU in a few minutes.

GPU time comes in short slices on a machine that reaches no package registry and already holds
PyTorch (CUDA), Triton, numpy, pandas, pyarrow, tiktoken, safetensors and transformers, but not
MLflow, Dagster, datatrove, duckdb or torchao. So the check's own process imports only the pieces of
`ghostvis_core` that need nothing more (tests/test_gpu_check.py keeps it so), and what else it needs
travels in the git-ignored `benchmarks/gpu_wheels/` (at most 48 of the 64 MiB a call carries), filled
here by `--prepare`: the wheels of torchao (float8) and of what the real trainer and the audit import
beyond the GPU machine's packages (gpu_trainer.carried: the MLflow client, SQLAlchemy, duckdb, ...),
downloaded from PyPI at this venv's versions for the GPU machine's Python, listed in `carried.json`,
and a data-only demo home (benchmarks/gpu_trainer.py), packed into one xz archive, `carried.tar.xz`
(`pack`). On the GPU machine the archive is unpacked and the wheels installed into a temporary folder
(`pip install --no-index --target`) put on sys.path and PYTHONPATH: nothing is installed there.

Parts, each on the working tree's code (figures in the JSON of --out, a short table last):
  - peak: bf16 FLOP/s of one large matmul (MFU is measured against it, not a datasheet);
  - pretrain_500m: the 500m preset's pretrain step (its micro batch and seq_len, bf16, torch.compile
    per block, the chunked loss, AdamW) through benchmarks/gpu_throughput.py's worker: tokens/s, MFU,
    peak memory against the memory plan (goals: MFU >= 0.45, plan within 15% of measured);
  - float8_500m: the same with runtime.float8 where the GPU has float8 (goal >= 1.15x over bf16);
  - attention: packed documents through the kernel the trainer picks (gpt.attention_kernel) against
    a dense-mask SDPA reference in fp32 on random inputs, outputs and gradients (relative error <=
    1e-2, bf16's), and the time of both;
  - fsdp_resume: FSDP2 on one GPU, a DCP save and a resume give the same loss on the next step;
  - trainer: 30 steps of the real trainer (`python -m ghostvis_core.run`, tiny preset) on the demo
    corpus, then the audit: the held-out loss falls, the ledger's figures equal the trainer's, every
    check passes (benchmarks/gpu_trainer.py);
  - trainer_vs_bare: the trainer part's tokens/s against benchmarks/_bare_loop.py on the same model,
    batch shape, precision and steps (goal >= 0.95, as on CPU: benchmarks/trainer_throughput.py).
It records the torch, CUDA and driver versions it ran on, against the torch scripts/install-torch pins.

The last table gives every part's goal, figure and verdict; the check exits 1 when a part errors or
misses its goal, 0 only when every goal is met. On a fresh clone (no carried folder) it names the
command to run first and exits 1; prepared but without a CUDA device it says "no CUDA device" and exits
0: there is nothing to check on this machine, and its table would be empty. `make gpu-check` prepares
the carried folder when it is missing, then runs the check.
(--trainer-on-cpu runs the trainer part alone without CUDA: benchmarks/gpu_check_isolated.py runs it
in an environment holding only the GPU machine's packages and the carried wheels.)

    make gpu-check                                            # here, with PyPI: prepare, then check
    .venv/bin/python benchmarks/gpu_check.py --prepare        # here, with PyPI: fill benchmarks/gpu_wheels
    python benchmarks/gpu_check.py --out gpu_check.json       # on the GPU machine, from the repository root
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

import gpu_trainer
import torch

ROOT = Path(__file__).resolve().parent.parent
BARE_LOOP = Path(__file__).resolve().parent / "_bare_loop.py"
PREPARE_FIRST = "make gpu-check (or: .venv/bin/python benchmarks/gpu_check.py --prepare), where PyPI is reachable"
WHEELS = Path(__file__).resolve().parent / "gpu_wheels"
CARRIED_ROOTS = ("torchao", *gpu_trainer.TRAINER_NEEDS)  # what the check needs beyond the GPU machine
GPU_PYTHON = "3.12"  # the GPU machine's Python: compiled wheels (duckdb, psutil, ...) must match it
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
CARRIED_LIST = "carried.json"  # the pins --prepare downloaded, for the Python it downloaded them for
ARCHIVE = "carried.tar.xz"  # the wheels (uncompressed inside) and the data-only home, xz-compressed
CARRY_LIMIT_BYTES = 48 * 2**20  # of the 64 MiB a device call carries: room for the tree and a new dependency
PEAK_MATMUL = 8192  # square bf16 matmul: large enough to keep every SM busy
GOAL_MFU = 0.45
GOAL_PLAN_ERROR = 0.15
GOAL_FLOAT8_SPEEDUP = 1.15
BF16_REL_ERROR = 1e-2
RESUME_TOLERANCE = 1e-4
GOAL_TRAINER_RATIO = 0.95


def prepare(python_version: str) -> int:
    """Download the carried wheels (binary only, each pinned, no dependencies resolved by pip) for the
    GPU machine's Python, record them in carried.json, build the data-only demo home, and pack both into
    the carried archive (`pack`)."""
    WHEELS.mkdir(exist_ok=True)
    for stale in WHEELS.glob("*.whl"):  # an earlier layout's loose wheels, maybe of other pins: not packed
        stale.unlink()
    pins = [f"{name}=={version}" for name, version in sorted(gpu_trainer.carried(CARRIED_ROOTS).items())]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(WHEELS)]
    cmd += ["--python-version", python_version, "--implementation", "cp"]
    cmd += [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run([*cmd, *pins], check=True)
    (WHEELS / CARRIED_LIST).write_text(json.dumps({"python": python_version, "pins": pins}, indent=2))
    print(f"building the data-only demo home in {WHEELS / 'home'} ...", flush=True)
    gpu_trainer.prepare_home(WHEELS / "home")
    pack(WHEELS)
    with tempfile.TemporaryDirectory() as tmp:
        return 0 if not carried_problems(Path(tmp)) else 1


def pack(folder: Path) -> None:
    """`folder`'s wheels and home/ into one xz archive (ARCHIVE), which replaces them. Each wheel goes in
    rewritten uncompressed (still a wheel: its RECORD hashes the files, not their compression), so xz
    compresses the shared libraries inside, which a wheel's deflate leaves twice as large."""
    wheels = sorted(folder.glob("*.whl"))
    with tempfile.TemporaryDirectory() as tmp, tarfile.open(folder / ARCHIVE, "w:xz", preset=9) as tar:
        for wheel in wheels:
            stored = Path(tmp) / wheel.name
            with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(stored, "w", zipfile.ZIP_STORED) as dst:
                for info in src.infolist():
                    dst.writestr(info, src.read(info), compress_type=zipfile.ZIP_STORED)
            tar.add(stored, arcname=wheel.name)
        tar.add(folder / "home", arcname="home")
    for wheel in wheels:
        wheel.unlink()
    shutil.rmtree(folder / "home")


def wheel_name(wheel: Path) -> str:
    """A wheel file's distribution name, normalized (PEP 503) like the pins."""
    return re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()


def carried_problems(unpacked: Path) -> list[str]:
    """What is wrong with the carried folder (empty when nothing), its archive unpacked into `unpacked`:
    carried.json and the archive there, under CARRY_LIMIT_BYTES, a wheel per pin, the data-only home.
    Prints its size and what it holds."""
    fix = f"fix: run {PREPARE_FIRST}"
    total = sum(f.stat().st_size for f in WHEELS.rglob("*") if f.is_file())
    print(f"carried folder: {os.path.relpath(WHEELS, ROOT)}, {total / 2**20:.1f} MiB in all")
    listed, archive = WHEELS / CARRIED_LIST, WHEELS / ARCHIVE
    pins = json.loads(listed.read_text())["pins"] if listed.exists() else []
    problems = [] if pins else [f"no {listed}; {fix}"]
    if total > CARRY_LIMIT_BYTES:
        problems.append(
            f"{WHEELS} holds {total / 2**20:.1f} MiB, above the {CARRY_LIMIT_BYTES / 2**20:.0f} MiB allowed"
        )
    if not archive.exists():
        return [*problems, f"no {archive}; {fix}"]
    with tarfile.open(archive) as tar:
        tar.extractall(unpacked, filter="data")
    wheels = sorted(unpacked.glob("*.whl"))
    for w in wheels:
        print(f"  {w.name} ({w.stat().st_size / 2**20:.1f} MiB unpacked)")
    names = {wheel_name(w) for w in wheels}
    problems += [f"no wheel of {pin} in {archive}; {fix}" for pin in pins if pin.split("==")[0] not in names]
    if not (unpacked / "home" / "store").is_dir():
        problems.append(f"no data-only demo home in {archive}; {fix}")
    problems += [f"{w.name} in {archive} is not a wheel (zip); {fix}" for w in wheels if not zipfile.is_zipfile(w)]
    return problems


def install_wheels(unpacked: Path, dest: Path) -> None:
    """The carried wheels (unpacked) installed into `dest` (pip, no index, no dependency resolution),
    importable here and in the workers and the trainer (PYTHONPATH)."""
    wheels = [str(w) for w in sorted(unpacked.glob("*.whl"))]
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target"]
    subprocess.run([*cmd, str(dest), *wheels], check=True)
    sys.path.insert(0, str(dest))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(dest), os.environ.get("PYTHONPATH", "")])


def rel_error(x, ref) -> float:
    return float((x.detach().float() - ref.detach().float()).norm() / ref.detach().float().norm())


def pretrain(bf16_peak: float, use_float8: bool, steps: int, warmup: int, packed: bool = False) -> dict:
    """The 500m preset's step on this GPU (gpu_throughput's worker under torchrun, one rank), with MFU
    against the measured peak and the memory plan's total for the same shape."""
    import gpu_throughput

    from ghostvis_core.plan import presets
    from ghostvis_core.plan.budget import flops_per_token, memory_plan

    r = gpu_throughput.run_case("500m", "ddp", steps, warmup, use_float8=use_float8, packed=packed)
    if "error" in r:
        return r
    cfg = presets.resolve("pretrain", "500m", {"batch.world_size": 1})
    planned = memory_plan(cfg, world_size=1).total_gb
    r["mfu_measured_peak"] = r["tokens_per_sec"] * flops_per_token(cfg.model, cfg.batch.seq_len) / bf16_peak
    r["planned_memory_gb"] = planned
    r["plan_error"] = (planned - r["peak_memory_gb"]) / r["peak_memory_gb"]
    return r


def block_pass(fns, xs, grads) -> None:
    """Forward and backward through each layer on its own input."""
    for fn, x, g in zip(fns, xs, grads):
        fn(x).backward(g)


def float8_linears(repeats: int = 20, tokens: int = 16384) -> dict:
    """The ceiling float8 sets on the speed-up: one decoder block's Linear layers (q, k, v, o and the
    three MLP ones) alone, forward and backward on `tokens` rows, bf16 against float8 (the trainer's
    conversion, each layer compiled), at the 500m preset's shapes and at the 7b's. The whole step's
    speed-up cannot beat the block's matmuls' (attention, the loss and the optimizer stay as they are)."""
    from torch import nn

    from ghostvis_core.plan import presets
    from ghostvis_core.run.train.float8 import convert

    dev = torch.device("cuda")
    out: dict = {"tokens": tokens}
    for preset in ("500m", "7b"):
        m = presets.resolve("pretrain", preset).model
        q, kv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
        shapes = [(m.d_model, q), (m.d_model, kv), (m.d_model, kv), (q, m.d_model)]
        shapes += [(m.d_model, m.ffn_hidden), (m.d_model, m.ffn_hidden), (m.ffn_hidden, m.d_model)]
        xs = [torch.randn(tokens, i, device=dev, dtype=torch.bfloat16, requires_grad=True) for i, _ in shapes]
        grads = [torch.randn(tokens, o, device=dev, dtype=torch.bfloat16) for _, o in shapes]
        ms = {}
        for kind in ("bf16", "float8"):
            layers = nn.ModuleList(nn.Linear(i, o, bias=False) for i, o in shapes).to(dev, torch.bfloat16)
            if kind == "float8":
                convert(layers)
            fns = [torch.compile(layer) for layer in layers]
            block_pass(fns, xs, grads)  # compilation
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(repeats):
                block_pass(fns, xs, grads)
            torch.cuda.synchronize()
            ms[kind] = (time.perf_counter() - start) / repeats * 1e3
        out[preset] = {"bf16_ms": ms["bf16"], "float8_ms": ms["float8"], "speedup": ms["bf16"] / ms["float8"]}
    return out


def attention(repeats: int = 10) -> dict:
    """The trainer's packed-document attention against a dense-mask SDPA reference (fp32), on the
    500m preset's heads and seq_len: relative error of the output and of q's gradient, and times."""
    import gpu_throughput
    import torch.nn.functional as F

    from ghostvis_core.plan import presets
    from ghostvis_core.run.model import gpt

    m, b = presets.resolve("pretrain", "500m").model, presets.resolve("pretrain", "500m").batch
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    t = b.seq_len
    doc_ids = gpu_throughput.document_ids(b.micro_batch_size, t, g).to(dev)
    q = torch.randn(b.micro_batch_size, t, m.n_heads, m.head_dim, device=dev, dtype=torch.bfloat16)
    k, v = (
        torch.randn(b.micro_batch_size, t, m.n_kv_heads, m.head_dim, device=dev, dtype=torch.bfloat16) for _ in range(2)
    )
    kernel = gpt.attention_kernel(dev, half=True)
    gqa = m.n_kv_heads != m.n_heads

    spans = gpt.DocSpans.from_doc_ids(doc_ids, kernel)  # once per micro-batch in the trainer: timed apart

    def packed(q, k, v):
        return gpt.varlen_attention(q, k, v, spans, gqa)

    same = doc_ids[:, :, None] == doc_ids[:, None, :]
    mask = (same & torch.ones(t, t, dtype=torch.bool, device=dev).tril())[:, None]

    def dense(q, k, v):
        return F.scaled_dot_product_attention(
            *(x.transpose(1, 2) for x in (q, k, v)), attn_mask=mask, enable_gqa=gqa
        ).transpose(1, 2)

    def run(fn, dtype):
        qq, kk, vv = (x.to(dtype).requires_grad_() for x in (q, k, v))
        y = fn(qq, kk, vv)
        y.float().square().mean().backward()
        return y, qq.grad

    y_ref, gq_ref = run(dense, torch.float32)
    y, gq = run(packed, torch.bfloat16)
    out = {"kernel": kernel, "output_rel_error": rel_error(y, y_ref), "grad_q_rel_error": rel_error(gq, gq_ref)}
    for name, fn in (("packed", packed), ("dense_mask_bf16", dense)):
        run(fn, torch.bfloat16)  # warm-up (compilation)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            run(fn, torch.bfloat16)
        torch.cuda.synchronize()
        out[f"{name}_fwd_bwd_ms"] = (time.perf_counter() - start) / repeats * 1e3
    # the block mask, built once per micro-batch: eager against compiled (the trainer's on CUDA), each
    # repeat on other documents (a compiled build that recompiled per batch would show here), same masks
    runs = [gpu_throughput.document_ids(b.micro_batch_size, t, g).to(dev) for _ in range(repeats + 1)]
    runs = [torch.cat([torch.ones_like(r[:, :1]), (r[:, 1:] != r[:, :-1]).int()], 1).cumsum(1) for r in runs]
    masks = {}
    for compiled in (False, True):
        gpt._document_block_mask(runs[0], compiled=compiled)  # warm-up (compilation)
        torch.cuda.synchronize()
        start = time.perf_counter()
        masks[compiled] = [gpt._document_block_mask(r, compiled=compiled) for r in runs[1:]]
        torch.cuda.synchronize()
        out[f"spans_{'compiled' if compiled else 'eager'}_ms"] = (time.perf_counter() - start) / repeats * 1e3
    out["spans_same"] = all(
        torch.equal(a.kv_num_blocks, c.kv_num_blocks) and torch.equal(a.kv_indices, c.kv_indices)
        for a, c in zip(masks[False], masks[True])
    )
    out["ok"] = max(out["output_rel_error"], out["grad_q_rel_error"]) <= BF16_REL_ERROR and out["spans_same"]
    return out


def fsdp_resume(dev: torch.device, d_model: int = 512, seq_len: int = 512) -> dict:
    """FSDP2 over a one-rank group (NCCL on a GPU, gloo on a CPU): two steps, a committed DCP save, two
    more steps; then a model of other initial weights, resumed from the save, takes the same two steps.
    Losses must agree to within RESUME_TOLERANCE (a GPU's atomics make backward passes differ in the
    last bits)."""
    import shutil

    import torch.distributed as dist

    from ghostvis_core.plan.config import ModelConfig
    from ghostvis_core.run.model.gpt import GPT
    from ghostvis_core.run.train import checkpoint as ckpt
    from ghostvis_core.run.train.parallel import Sharded

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    if dev.type == "cuda":
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev)
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)
    cfg = ModelConfig(
        vocab_size=4096,
        d_model=d_model,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        ffn_hidden=d_model * 11 // 4,
        max_seq_len=seq_len,
    )
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.vocab_size, (4, seq_len + 1), generator=g).to(dev) for _ in range(4)]

    def model_and_opt(seed: int):
        torch.manual_seed(seed)
        par = Sharded(GPT(cfg).to(dev), bf16=True)
        return par, torch.optim.AdamW(par.model.parameters(), lr=1e-3)

    def step(par, opt, x) -> float:
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = par.forward_module(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    try:
        with tempfile.TemporaryDirectory() as tmp:
            par, opt = model_and_opt(0)
            for x in batches[:2]:
                step(par, opt, x)
            staged = ckpt.save_shards(Path(tmp), 2, par.model, opt)[ckpt.DCP_DIR]
            saved = Path(tmp) / "step-2"
            saved.mkdir()
            shutil.move(staged, saved / ckpt.DCP_DIR)
            ckpt.write_marker(saved, 2)  # committed as the trainer commits: loading verifies every file
            uninterrupted = [step(par, opt, x) for x in batches[2:]]
            par2, opt2 = model_and_opt(1)  # other initial weights: only the checkpoint can make them agree
            ckpt.load_model(saved, par2.model)
            ckpt.load_optimizer(saved, par2.model, opt2)
            resumed = [step(par2, opt2, x) for x in batches[2:]]
    finally:
        dist.destroy_process_group()
    worst = max(abs(a - b) / abs(a) for a, b in zip(uninterrupted, resumed))
    return {"uninterrupted": uninterrupted, "resumed": resumed, "max_rel_diff": worst, "ok": worst <= RESUME_TOLERANCE}


def table(results: dict) -> list[str]:
    """The short summary printed last: each part, its figure and its goal."""
    lines = []
    if "gpu" in results:  # not with --trainer-on-cpu
        lines.append(
            f"GPU: {results['gpu']}  bf16 peak (measured, {PEAK_MATMUL}^3 matmul): {results['peak_tflops']:.0f} TFLOP/s"
        )
    for name, label in (("pretrain_500m", "pretrain 500m bf16  "), ("pretrain_500m_packed", "  packed documents  ")):
        r = results.get(name, {})
        if "error" in r:
            lines.append(f"{label} failed: {r['error']}")
        elif r:
            lines.append(
                f"{label} {r['tokens_per_sec']:>10,.0f} tok/s  MFU {r['mfu_measured_peak']:.1%} "
                f"(goal >= {GOAL_MFU:.0%})  peak {r['peak_memory_gb']:.1f} GB, plan {r['planned_memory_gb']:.1f} GB "
                f"({r['plan_error']:+.0%}, goal within {GOAL_PLAN_ERROR:.0%})"
            )
    p = results.get("pretrain_500m", {})
    f8 = results.get("float8_500m", {})
    if "skipped" in f8 or "error" in f8:
        lines.append(f"pretrain 500m float8 {f8.get('skipped') or 'failed: ' + f8['error']}")
    elif f8 and "error" not in p:
        speedup = f8["tokens_per_sec"] / p["tokens_per_sec"]
        lines.append(
            f"pretrain 500m float8 {f8['tokens_per_sec']:>10,.0f} tok/s  {speedup:.2f}x bf16 "
            f"(goal >= {GOAL_FLOAT8_SPEEDUP}x)"
        )
    f8l = results.get("float8_linears", {})
    if "error" in f8l:
        lines.append(f"float8 block linears failed: {f8l['error']}")
    elif "500m" in f8l:
        lines.append(
            "float8 block linears "
            + ", ".join(f"{p} {f8l[p]['speedup']:.2f}x" for p in ("500m", "7b"))
            + f" bf16 (the ceiling of a step's speed-up; {f8l['tokens']:,} tokens)"
        )
    for name in ("attention", "fsdp_resume"):
        r = results.get(name, {})
        if not r:
            continue
        if "error" in r:
            lines.append(f"{name:<20} failed: {r['error']}")
        elif name == "attention":
            lines.append(
                f"attention ({r['kernel']})  rel error out {r['output_rel_error']:.1e} "
                f"grad {r['grad_q_rel_error']:.1e} (<= {BF16_REL_ERROR:.0e})  {r['packed_fwd_bwd_ms']:.1f} ms "
                f"vs dense mask {r['dense_mask_bf16_fwd_bwd_ms']:.1f} ms; block mask per micro-batch "
                f"{r['spans_compiled_ms']:.1f} ms compiled, {r['spans_eager_ms']:.1f} ms eager "
                f"({'same masks' if r['spans_same'] else 'DIFFERENT masks'})"
            )
        else:
            verdict = "same losses" if r["ok"] else "DIFFERENT losses"
            lines.append(f"fsdp2 DCP resume     {verdict} (max rel diff {r['max_rel_diff']:.1e}): {r['resumed']}")
    t = results.get("trainer", {})
    if "error" in t:
        lines.append(f"trainer              failed: {t['error']}")
    elif t:
        agree = "ledger = trainer = MLflow = recount" if t["ledger_equals_trainer"] else "figures DISAGREE"
        lines.append(
            f"trainer {t['steps']} steps      held-out loss {t['val_loss_start']:.3f} -> {t['val_loss']:.3f}"
            f"{'' if t['loss_fell'] else ' (did NOT fall)'}  {agree}  audit "
            f"{'passed' if not t['audit_failures'] else 'FAILED: ' + '; '.join(t['audit_failures'])}  "
            f"{t['tokens_per_sec']:,.0f} tok/s, {t['wall_s']:.0f} s launch to audit ({t['attention_kernel']})"
        )
    return lines


def guarded(fn, *args) -> dict:
    """A part's figures, or its error: one failing part must not hide the others' figures (its verdict
    is ERROR in the last table, and the check exits 1)."""
    try:
        return fn(*args)
    except Exception as exc:  # reported in the table and the JSON
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}


def torch_pin() -> str:
    """The torch version the project installs (scripts/install-torch's default)."""
    found = re.search(r"GHOSTVIS_TORCH_VERSION:-([0-9.]+)", (ROOT / "scripts" / "install-torch").read_text())
    return found.group(1) if found else "unknown (no pin in scripts/install-torch)"


def driver_version() -> str:
    """The NVIDIA driver's version (nvidia-smi), or why it is unknown."""
    try:
        proc = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
        )
    except OSError as exc:
        return f"unknown ({exc.strerror}: nvidia-smi)"
    return proc.stdout.strip().splitlines()[0] if proc.returncode == 0 and proc.stdout.strip() else "unknown"


def versions() -> dict:
    """What the check ran on: torch (and the version the project pins), its CUDA, the driver."""
    return {
        "torch": torch.__version__,
        "torch_pin": torch_pin(),
        "cuda": torch.version.cuda,
        "driver": driver_version(),
    }


def trainer_vs_bare(trainer: dict, steps: int) -> dict:
    """The trainer part's tokens/s against benchmarks/_bare_loop.py on this GPU with the trainer run's own
    config (model, micro-batch shape, grad accumulation, AdamW, clipping, seed), one rank, as many steps,
    bf16: both timed from the end of step 1 to the end of the last step."""
    if not trainer or "error" in trainer:
        raise RuntimeError(f"no trainer figure to compare: {trainer.get('error') if trainer else 'trainer not run'}")
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "spec.json"
        spec.write_text(json.dumps({"config": trainer["config"]}))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", str(BARE_LOOP)]
        proc = subprocess.run(
            [*cmd, "--spec", str(spec), "--steps", str(steps), "--precision", "bf16"], capture_output=True, text=True
        )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("BARE_RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"bare loop exited {proc.returncode}: {gpu_trainer.last_error(proc.stdout + proc.stderr)}")
    bare = json.loads(lines[-1].split(" ", 1)[1])
    ratio = trainer["tokens_per_sec"] / bare["tokens_per_sec"]
    return {"trainer_tokens_per_sec": trainer["tokens_per_sec"], "bare_tokens_per_sec": bare["tokens_per_sec"],
            "ratio": ratio, "steps": steps}  # fmt: skip


def main() -> int:
    global WHEELS  # --wheels: every function reads the carried folder from here
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--prepare", action="store_true", help="fill benchmarks/gpu_wheels from PyPI (here, not on the GPU)"
    )
    ap.add_argument("--out", type=Path, default=Path("gpu_check.json"), help="where the full figures go (JSON)")
    ap.add_argument("--steps", type=int, default=20, help="timed pretrain steps")
    ap.add_argument("--warmup", type=int, default=5, help="untimed pretrain steps first (compilation)")
    ap.add_argument("--wheels", type=Path, default=WHEELS, help="the carried folder (default benchmarks/gpu_wheels)")
    ap.add_argument("--python-version", default=GPU_PYTHON, help="--prepare: the Python the wheels are for")
    ap.add_argument("--trainer-preset", default=gpu_trainer.PRESET, help="the trainer part's preset")
    ap.add_argument("--trainer-steps", type=int, default=gpu_trainer.STEPS, help="the trainer part's steps")
    ap.add_argument("--parts", nargs="*", help="only these parts (default: all)")
    ap.add_argument("--trainer-on-cpu", action="store_true", help=argparse.SUPPRESS)  # gpu_check_isolated.py
    args = ap.parse_args()
    WHEELS = args.wheels.resolve()
    if args.prepare:
        return prepare(args.python_version)
    tmp = tempfile.TemporaryDirectory()
    unpacked, installed = Path(tmp.name) / "carried", Path(tmp.name) / "installed"
    problems = carried_problems(unpacked)
    for p in problems:
        print(f"carried folder: {p}")
    if problems:
        print(f"first run: {PREPARE_FIRST}")
        return 1
    if not torch.cuda.is_available() and not args.trainer_on_cpu:
        print("no CUDA device: nothing to measure here; run the check on a GPU machine")
        return 0
    sys.path.insert(0, str(ROOT))
    install_wheels(unpacked, installed)
    log = args.out.with_name("trainer.log")
    trainer = (gpu_trainer.run_trainer, unpacked / "home", log, args.trainer_preset, args.trainer_steps)
    if args.trainer_on_cpu:
        return report(args.out, {"trainer": guarded(*trainer)})
    return report(args.out, measure(args, trainer))


def measure(args, trainer: tuple) -> dict:
    """Every part (or those of --parts) on CUDA device 0, in order; the JSON rewritten after each, so a
    call cut short still returns the parts done."""
    from ghostvis_core.run.train.efficiency import measured_matmul_flops

    dev = torch.device("cuda", 0)
    peak = measured_matmul_flops(dev, torch.bfloat16, n=PEAK_MATMUL, repeats=10)
    results: dict = {"gpu": torch.cuda.get_device_name(dev), "versions": versions(), "peak_tflops": peak / 1e12}
    print(f"{results['gpu']}, {results['versions']}, bf16 peak {peak / 1e12:.0f} TFLOP/s", flush=True)
    import gpu_throughput

    no_float8 = gpu_throughput.float8_unavailable()
    parts = {
        "attention": (attention,),
        "fsdp_resume": (fsdp_resume, dev),
        "pretrain_500m": (pretrain, peak, False, args.steps, args.warmup),
        "pretrain_500m_packed": (pretrain, peak, False, args.steps, args.warmup, True),
        "float8_500m": (pretrain, peak, True, args.steps, args.warmup),
        "float8_linears": (float8_linears,),
        "trainer": trainer,
        "trainer_vs_bare": (lambda: trainer_vs_bare(results.get("trainer", {}), args.trainer_steps),),
    }
    for name, (fn, *fn_args) in parts.items():
        if args.parts and name not in args.parts:
            continue
        if name.startswith("float8") and no_float8:
            results[name] = {"skipped": f"not measured: {no_float8}"}
            continue
        if name == "trainer":
            torch.cuda.empty_cache()  # the trainer's own process takes the GPU next
        start = time.perf_counter()
        results[name] = guarded(fn, *fn_args)
        results[name]["part_wall_s"] = time.perf_counter() - start
        args.out.write_text(json.dumps(results, indent=2))
        print(f"{name} done in {results[name]['part_wall_s']:.0f} s", flush=True)
    return results


def _figure(name: str, r: dict, results: dict) -> tuple[str, str, bool | None]:
    """A measured part's (goal, figure, goal met); None: a figure without a goal."""
    if name == "versions":
        base = r["torch"].split("+")[0]
        return (
            f"torch {r['torch_pin']} (the pin)",
            f"torch {r['torch']}, CUDA {r['cuda']}, driver {r['driver']}",
            (base == r["torch_pin"]),
        )
    if name.startswith("pretrain_500m"):
        figure = f"MFU {r['mfu_measured_peak']:.1%}, memory plan {r['plan_error']:+.0%} of measured"
        goal = f"MFU >= {GOAL_MFU:.0%}, plan within {GOAL_PLAN_ERROR:.0%}"
        return goal, figure, r["mfu_measured_peak"] >= GOAL_MFU and abs(r["plan_error"]) <= GOAL_PLAN_ERROR
    if name == "float8_500m":
        bf16 = results.get("pretrain_500m", {}).get("tokens_per_sec")
        speedup = r["tokens_per_sec"] / bf16 if bf16 else float("nan")
        return f">= {GOAL_FLOAT8_SPEEDUP}x bf16", f"{speedup:.2f}x bf16", speedup >= GOAL_FLOAT8_SPEEDUP
    if name == "float8_linears":
        return (
            "(the ceiling of float8's step speed-up)",
            f"500m {r['500m']['speedup']:.2f}x, 7b {r['7b']['speedup']:.2f}x",
            None,
        )
    if name == "attention":
        worst = max(r["output_rel_error"], r["grad_q_rel_error"])
        return f"rel error <= {BF16_REL_ERROR:.0e}, same block masks", f"rel error {worst:.1e}", r["ok"]
    if name == "fsdp_resume":
        met = r["max_rel_diff"] <= RESUME_TOLERANCE
        return f"rel diff <= {RESUME_TOLERANCE:.0e}", f"rel diff {r['max_rel_diff']:.1e}", met
    if name == "trainer":
        agree = "figures agree" if r["ledger_equals_trainer"] else "figures DISAGREE"
        audit = "audit passed" if not r["audit_failures"] else f"audit FAILED ({len(r['audit_failures'])})"
        loss = f"loss {r['val_loss_start']:.3f} -> {r['val_loss']:.3f}"
        return "loss falls, ledger = trainer, audit passes", f"{loss}, {agree}, {audit}", r["ok"]
    figure = f"{r['ratio']:.3f} ({r['trainer_tokens_per_sec']:,.0f} / {r['bare_tokens_per_sec']:,.0f} tok/s)"
    return f"trainer/bare tokens/s >= {GOAL_TRAINER_RATIO}", figure, r["ratio"] >= GOAL_TRAINER_RATIO


VERDICT_PARTS = ("versions", "attention", "fsdp_resume", "pretrain_500m", "pretrain_500m_packed", "float8_500m",
                 "float8_linears", "trainer", "trainer_vs_bare")  # fmt: skip


def verdicts(results: dict) -> list[tuple[str, str, str, str]]:
    """Each part run: (part, goal, figure, verdict), the verdict pass, FAIL (goal missed), ERROR (the part
    failed), skipped (float8 on a GPU without it) or info (a figure without a goal)."""
    rows = []
    for name in VERDICT_PARTS:
        r = results.get(name)
        if r is None:
            continue
        if "error" in r or "skipped" in r:
            rows.append((name, "-", r.get("error") or r["skipped"], "ERROR" if "error" in r else "skipped"))
            continue
        try:
            goal, figure, met = _figure(name, r, results)
        except (KeyError, TypeError, ZeroDivisionError) as exc:
            rows.append((name, "-", f"incomplete figures ({type(exc).__name__}: {exc})", "ERROR"))
            continue
        rows.append((name, goal, figure, "info" if met is None else "pass" if met else "FAIL"))
    return rows


def report(out: Path, results: dict) -> int:
    """The full figures as JSON, the part lines, then the verdict table last. 0 only when no part errored
    or missed its goal; 1 otherwise, naming them."""
    out.write_text(json.dumps(results, indent=2))
    print(f"figures: {out}")
    print("\n".join(table(results)))
    rows = verdicts(results)
    widths = [max(len(row[i]) for row in [("part", "goal", "figure", "verdict"), *rows]) for i in range(4)]
    print()
    for row in [("part", "goal", "figure", "verdict"), *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    failed = [row[0] for row in rows if row[3] in ("FAIL", "ERROR")] or ([] if rows else ["no part measured"])
    print(f"gpu check: {'FAILED: ' + ', '.join(failed) if failed else 'every goal met'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

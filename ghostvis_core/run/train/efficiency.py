"""Measured efficiency: model FLOPs per token, the device's peak, MFU and CUDA memory per step.

MFU = tokens/s x model FLOPs per token / (world_size x peak FLOP/s of one device). The peak is the
GPU table's dense bf16 figure for a known CUDA device (budget.GPUS); anywhere else (a CPU, an
unlisted GPU) it is measured: the best of a few square matmuls in the run's compute precision on
the run's threads, so a CPU's MFU says how close the trainer gets to what its matmuls can do.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ghostvis_core.plan.budget import GB, GPUS, flops_per_token, gpu_of
from ghostvis_core.plan.config import StageConfig

MATMUL_SIZE = 512  # square matmul used to measure a peak: cache-resident, so it shows the cores, not memory
MATMUL_REPEATS = 20  # best of: on a shared machine most single timings are slowed by other work


@dataclass(frozen=True)
class Efficiency:
    flops_per_token: float  # model FLOPs (forward + backward, attention included) per trained token
    peak_flops: float  # one device's peak FLOP/s in the run's precision
    peak_source: str  # "table:H100" or "measured:cpu"
    world_size: int

    def mfu(self, tokens_per_sec: float) -> float:
        return tokens_per_sec * self.flops_per_token / (self.world_size * self.peak_flops)

    def metrics(self, tokens_per_sec: float, device: torch.device) -> dict[str, float]:
        """The per-step efficiency metrics (MLflow)."""
        out = {"throughput/mfu": self.mfu(tokens_per_sec), "throughput/flops_per_token": self.flops_per_token}
        if device.type == "cuda":
            out |= {
                "memory/cuda_allocated_gb": torch.cuda.memory_allocated(device) / GB,
                "memory/cuda_peak_gb": torch.cuda.max_memory_allocated(device) / GB,
            }
        return out


def efficiency(cfg: StageConfig, device: torch.device, bf16: bool, world_size: int) -> Efficiency:
    peak, source = device_peak_flops(device, bf16)
    return Efficiency(flops_per_token(cfg.model, cfg.batch.seq_len), peak, source, world_size)


def device_peak_flops(device: torch.device, bf16: bool) -> tuple[float, str]:
    """(peak FLOP/s, where the figure comes from) of the device this rank computes on."""
    if device.type == "cuda" and bf16:
        name = gpu_of(torch.cuda.get_device_name(device))
        if name is not None:
            return GPUS[name].bf16_flops, f"table:{name}"
    return measured_matmul_flops(device, torch.bfloat16 if bf16 else torch.float32), f"measured:{device.type}"


def measured_matmul_flops(
    device: torch.device, dtype: torch.dtype, n: int = MATMUL_SIZE, repeats: int = MATMUL_REPEATS
) -> float:
    """Best FLOP/s of an n x n x n matmul (2 n^3 FLOPs) over a few repeats, after one warm-up."""
    g = torch.Generator(device=device).manual_seed(0)  # its own generator: the run's RNG stream is untouched
    a, b = (torch.randn(n, n, device=device, generator=g).to(dtype) for _ in range(2))
    best = float("inf")
    for i in range(repeats + 1):
        _sync(device)
        start = time.perf_counter()
        a @ b
        _sync(device)
        if i:  # the first is the warm-up
            best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

"""Runtime choices from the hardware: bf16 when asked for, or `auto` where the hardware does bf16 matmuls
fast; torch.compile where it pays."""

from __future__ import annotations

from pathlib import Path

import torch


def use_bf16(precision: str, device: torch.device) -> bool:
    """`runtime.precision` (auto, bf16 or fp32: the resolved config holds no other value) on this device."""
    if precision == "bf16":
        return True
    if precision == "fp32":
        return False
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return cpu_has_bf16_matmul()


def use_compile(setting: str, device: torch.device) -> bool:
    """torch.compile per block: `auto` compiles on CUDA only (on CPU compilation costs more than it saves)."""
    return setting == "on" or (setting == "auto" and device.type == "cuda")


def cpu_has_bf16_matmul() -> bool:
    """AMX-BF16 or AVX512-BF16: oneDNN runs bf16 matmuls several times faster than fp32 there."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split("flags")[1].split("\n")[0].split()
    except (OSError, IndexError):
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags

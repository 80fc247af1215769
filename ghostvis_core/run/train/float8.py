"""float8 training (`runtime.float8`): the decoder's Linear layers run their matmuls in float8 through
torchao's float8 training API (dynamic tensor-wise scales), the way torchtitan, nanochat and OLMo-core
train on H100s. Only the matmuls change: each converted layer keeps its high-precision weight as an
ordinary parameter under the same name, so the optimizer, FSDP, checkpoints and the Hugging Face export
see the same model as without float8 (a float8 checkpoint loads into an unconverted model and back).

Which layers convert (`float8_filter`), as torchtitan decides: nn.Linear whose two dimensions both
divide by 16 (the float8 tensor cores' requirement), except those named in SKIP."""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from ghostvis_core.errors import GhostvisError

# lm_head: the loss reads its weight through the chunked F.linear in lm_loss, never its forward, so a
# converted head would change nothing but its type (torchtitan also keeps the output layer in bf16 for
# accuracy). vision: the encoder is frozen after vision_alignment and its patch widths are small.
SKIP = ("lm_head", "vision")
MIN_CAPABILITY = (8, 9)  # Ada / Hopper and later: the first GPUs with float8 tensor cores


def float8_filter(module: nn.Module, fqn: str) -> bool:
    """torchao's module_filter_fn: True for the Linear layers that take float8 matmuls."""
    if not isinstance(module, nn.Linear) or fqn.split(".")[0] in SKIP:
        return False
    out_features, in_features = module.weight.shape
    return out_features % 16 == 0 and in_features % 16 == 0


def float8_layers(model: nn.Module) -> list[str]:
    """The names of the layers `convert` swaps, in module order."""
    return [name for name, m in model.named_modules() if float8_filter(m, name)]


def require_float8(device: torch.device) -> None:
    """Refuse float8 where it cannot run: no CUDA device, a GPU before compute capability 8.9, or no
    torchao. Raised in the trainer on the device it will train on, before any weight is loaded."""
    fix = "set runtime.float8=false (e.g. --set runtime.float8=false) to train in bf16"
    if device.type != "cuda":
        raise GhostvisError(
            f"runtime.float8=true needs an NVIDIA GPU with float8 tensor cores (compute capability "
            f">= 8.9: H100, H200, L4, L40S, RTX 4090); this rank trains on {device.type}; {fix}"
        )
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        raise GhostvisError(
            f"runtime.float8=true needs compute capability >= 8.9 (H100-class); "
            f"{torch.cuda.get_device_name(device)} has {cap[0]}.{cap[1]}; {fix}"
        )
    if importlib.util.find_spec("torchao") is None:
        raise GhostvisError(
            f"runtime.float8=true needs torchao: install the GPU extra (.venv/bin/pip install -e '.[gpu]'), or {fix}"
        )


def convert(model: nn.Module) -> list[str]:
    """Swap the filtered Linear layers for torchao Float8Linear in place (before torch.compile and the
    parallel wrapper, as torchao requires); returns the converted layers' names."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    names = float8_layers(model)
    convert_to_float8_training(
        model, config=Float8LinearConfig.from_recipe_name("tensorwise"), module_filter_fn=float8_filter
    )
    return names

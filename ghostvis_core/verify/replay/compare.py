"""Weights and optimizer state against a checkpoint's files, tensor by tensor, bit for bit: the first tensor
(weights first, in the checkpoint's order) whose bytes differ, how many differ, and the largest absolute
difference (among the weights when a weight differs: an optimizer step counter's difference of 1 says less)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from ghostvis_core.run.train import checkpoint as ckpt


@dataclass
class Comparison:
    tensors: int = 0  # compared
    differing: list[str] = field(default_factory=list)
    largest: tuple[str, float] | None = None  # (tensor, its largest absolute difference) of the differing ones

    def add(self, name: str, mine: torch.Tensor | None, theirs: torch.Tensor | None) -> None:
        """One tensor; absent on either side, or of another shape or dtype, it differs without bound."""
        self.tensors += 1
        if mine is None or theirs is None or mine.shape != theirs.shape or mine.dtype != theirs.dtype:
            self.differing.append(name)
            self.largest = (name, float("inf"))
            return
        if torch.equal(_bytes(mine), _bytes(theirs)):
            return
        self.differing.append(name)
        diff = float((mine.double() - theirs.double()).abs().max())
        if self.largest is None or diff > self.largest[1]:
            self.largest = (name, diff)

    def add_all(self, mine: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> None:
        for name, theirs in saved.items():
            self.add(name, mine.get(name), theirs)
        for name in sorted(set(mine) - set(saved)):
            self.add(name, mine[name], None)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def verdict(weights: Comparison, optimizer: Comparison) -> dict:
    differing = weights.differing + optimizer.differing
    return {
        "tensors_compared": weights.tensors + optimizer.tensors,
        "bitwise_equal": weights.tensors > 0 and not differing,
        "first_differing": differing[0] if differing else None,
        "differing": len(differing),
        "largest_difference": list(weights.largest or optimizer.largest or []) or None,
    }


def compare_with(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The model's weights (model.safetensors) and optimizer state (optimizer.safetensors, keyed
    `<parameter>::<field>`) against the checkpoint at `path`, verified against its marker first."""
    ckpt.verify(path)
    weights, state = Comparison(), Comparison()
    weights.add_all(model.state_dict(), load_file(str(path / "model.safetensors")))
    state.add_all(ckpt.optimizer_tensors(model, optimizer), load_file(str(path / "optimizer.safetensors")))
    return verdict(weights, state)


def trained_parameters(path: Path) -> set[str]:
    """The parameters the run trained: those the checkpoint's optimizer state holds."""
    return {key.split("::")[0] for key in load_file(str(path / "optimizer.safetensors"))}

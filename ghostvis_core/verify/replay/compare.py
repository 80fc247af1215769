"""Weights and optimizer state against a checkpoint's files, tensor by tensor, bit for bit: the first tensor
(in the checkpoint's order) whose bytes differ, how many differ, and the largest absolute difference."""

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

    @property
    def equal(self) -> bool:
        return self.tensors > 0 and not self.differing

    def add(self, name: str, mine: torch.Tensor | None, theirs: torch.Tensor) -> None:
        self.tensors += 1
        if mine is None or mine.shape != theirs.shape or mine.dtype != theirs.dtype:
            self.differing.append(name)
            self.largest = self.largest or (name, float("inf"))
            return
        if torch.equal(_bytes(mine), _bytes(theirs)):
            return
        self.differing.append(name)
        diff = float((mine.double() - theirs.double()).abs().max())
        if self.largest is None or diff > self.largest[1]:
            self.largest = (name, diff)

    def to_dict(self) -> dict:
        return {
            "tensors_compared": self.tensors,
            "bitwise_equal": self.equal,
            "first_differing": self.differing[0] if self.differing else None,
            "differing": len(self.differing),
            "largest_difference": list(self.largest) if self.largest else None,
        }


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def compare_with(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Comparison:
    """The model's weights (model.safetensors) and optimizer state (optimizer.safetensors, keyed
    `<parameter>::<field>`) against the checkpoint at `path`, verified against its marker first."""
    ckpt.verify(path)
    out = Comparison()
    weights = model.state_dict()
    for name, saved in load_file(str(path / "model.safetensors")).items():
        out.add(name, weights.get(name), saved)
    state = ckpt.optimizer_tensors(model, optimizer)
    for name, saved in load_file(str(path / "optimizer.safetensors")).items():
        out.add(name, state.get(name), saved)
    return out


def trained_parameters(path: Path) -> set[str]:
    """The parameters the run trained: those the checkpoint's optimizer state holds."""
    return {key.split("::")[0] for key in load_file(str(path / "optimizer.safetensors"))}

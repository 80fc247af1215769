"""Muon for the hidden weight matrices, AdamW for everything else, in one optimizer.

Muon (Keller Jordan, 2024; the optimizer of the modded-nanogpt and nanochat speed runs) keeps a
Nesterov momentum of the gradient and replaces the update by its orthogonalization: the nearest
semi-orthogonal matrix U V^T of the update U S V^T, computed with five Newton-Schulz iterations
instead of an SVD. Every direction of the matrix then moves by the same amount, which the rare
directions of a plain gradient step do not. It is defined for matrices acting on hidden states; the
embedding table, the LM head, norms and biases keep AdamW (`param_groups`).

One optimizer with two kinds of parameter groups (`use_muon`), not two optimizers: the trainer's
loop, gradient clipping, the LR schedule and both checkpoint formats see one `torch.optim.Optimizer`
whose state is tensors only (momentum buffers; AdamW's moments and step), so `checkpoint.py` saves
and resumes it unchanged.

Sharded parameters (FSDP2 DTensors, rows split over ranks): the orthogonalization of a matrix needs
the whole matrix, and orthogonalizing each shard alone would be a different optimizer whose result
depends on the world size. Each rank therefore gathers the full momentum-updated gradient of a
matrix (`full_tensor`, one all-gather of the matrix), orthogonalizes it and keeps its own rows. The
momentum buffer stays sharded like the gradient. Every rank repeats the Newton-Schulz iterations:
they cost a few matrix products per weight matrix per step, small next to the forward and backward
passes, and the alternative (one owner rank per matrix, then a scatter) needs more collectives to
schedule. Results equal DDP's up to the order of the gradient reductions.
"""

from __future__ import annotations

import math

import torch

from ghostvis_core.plan.config import OptimConfig

# The quintic Newton-Schulz coefficients of Muon's reference implementation: they push every singular
# value of the normalized matrix into roughly [0.7, 1.2] in five steps (fast, not exact convergence).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
ADAM_EPS = 1e-8


def zeropower_via_newtonschulz5(g: torch.Tensor, steps: int = NS_STEPS) -> torch.Tensor:
    """The orthogonalization U V^T of a matrix U S V^T, approximately: an odd polynomial of the matrix,
    so the singular vectors are exactly the input's and only the singular values move (towards 1).
    In fp32 whatever the device, so DDP, FSDP and a resumed run compute the same update."""
    a, b, c = NS_COEFFICIENTS
    x = g.float()
    tall = x.size(-2) > x.size(-1)
    if tall:  # iterate on the smaller Gram matrix
        x = x.mT
    x = x / (x.norm() + 1e-7)  # spectral norm <= Frobenius norm <= 1: inside the iteration's basin
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


def orthogonalized(update: torch.Tensor) -> torch.Tensor:
    """`zeropower_via_newtonschulz5` of a plain or sharded (DTensor) matrix; a DTensor comes back with
    its own placements (this rank's rows of the full matrix's orthogonalization)."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(update, DTensor):
        return zeropower_via_newtonschulz5(update).to(update.dtype)
    full = zeropower_via_newtonschulz5(update.full_tensor()).to(update.dtype)
    mesh = update.device_mesh
    replicated = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, update.placements)  # Replicate -> Shard: a local slice, no communication


class Muon(torch.optim.Optimizer):
    """Muon on the groups with `use_muon=True` (2-D weights), AdamW on the others. Each group carries
    its own lr; the trainer's schedule multiplies a group's `lr_scale` (muon_lr / lr for the Muon group).
    Decoupled weight decay (lr x weight_decay) on both kinds, as AdamW does."""

    def __init__(self, groups: list[dict], *, lr: float, momentum: float, betas: tuple[float, float]):
        for g in groups:
            if g.get("use_muon") and any(p.dim() != 2 for p in g["params"]):
                raise ValueError("Muon groups take 2-D weight matrices only; put vectors and tables in an AdamW group")
        super().__init__(
            groups, dict(lr=lr, weight_decay=0.0, momentum=momentum, betas=betas, use_muon=False, lr_scale=1.0)
        )

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                update = self._muon_update(p, group) if group["use_muon"] else self._adamw_update(p, group)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-group["lr"])
        return loss

    def _muon_update(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        """Nesterov momentum, orthogonalized, scaled by sqrt(rows / cols) for tall matrices so the
        update's per-entry size does not shrink with the aspect ratio (the reference's scaling)."""
        state = self.state[p]
        if not state:
            state["momentum_buffer"] = torch.zeros_like(p.grad)
        buf = state["momentum_buffer"]
        buf.lerp_(p.grad, 1 - group["momentum"])
        update = orthogonalized(p.grad.lerp(buf, group["momentum"]))
        return update * max(1.0, p.size(0) / p.size(1)) ** 0.5

    def _adamw_update(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        """torch.optim.AdamW's update (bias-corrected moments), without the lr."""
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        beta1, beta2 = group["betas"]
        state["step"] += 1
        t = state["step"].item()
        state["exp_avg"].lerp_(p.grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
        denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2**t)).add_(ADAM_EPS)
        return state["exp_avg"] / (1 - beta1**t) / denom


def muon_params(model: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(Muon's, AdamW's) trainable parameters: Muon takes the weight of every nn.Linear except the LM
    head (tied or not to the embedding); AdamW the embedding, the head, norms, biases and any other
    parameter (e.g. a resampler's latent array), which are tables and vectors, not hidden maps."""
    head = getattr(model, "lm_head", None)
    skip = {id(head.weight)} if head is not None else set()
    linear = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)} - skip
    params = [p for p in model.parameters() if p.requires_grad]
    return [p for p in params if id(p) in linear], [p for p in params if id(p) not in linear]


def make_muon(model: torch.nn.Module, o: OptimConfig) -> Muon:
    """The stage's optimizer for optim.name=muon. The AdamW groups come first (param_groups[0] is the
    lr the trainer logs); the Muon group's lr_scale makes the schedule (warmup, cosine) move muon_lr
    by the same factor as lr."""
    hidden, rest = muon_params(model)
    groups = [
        {"params": [p for p in rest if p.dim() >= 2], "weight_decay": o.weight_decay},
        {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0},
        {
            "params": hidden,
            "lr": o.muon_lr,
            "weight_decay": o.weight_decay,
            "use_muon": True,
            "lr_scale": o.muon_lr / o.lr,
        },
    ]
    return Muon([g for g in groups if g["params"]], lr=o.lr, momentum=o.muon_momentum, betas=(o.beta1, o.beta2))

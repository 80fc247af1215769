"""Atomic, pickle-free checkpoints.

<run>/step_000000150/ holds model.safetensors, optimizer.safetensors, train_state.json (the
TrainState: step, loader position, token counts, ledger part chain, MLflow run id, RNG states),
config.json and a COMPLETE marker.
It is written under a temporary name and renamed into place, so a reader that lists step_* folders
with COMPLETE only ever sees finished checkpoints; a crash mid-write leaves a .tmp folder that is
ignored and later removed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ghostvis_core.errors import GhostvisError
from ghostvis_core.train.state import STATE_FILE

_STEP_DIR = re.compile(r"^step_(\d{9})$")
MARKER = "COMPLETE"


@dataclass(frozen=True)
class CheckpointRef:
    path: Path
    step: int


def step_dir_name(step: int) -> str:
    return f"step_{step:09d}"


def is_step_dir(name: str) -> bool:
    return bool(_STEP_DIR.match(name))


def list_complete(run_dir: Path) -> list[CheckpointRef]:
    """Committed checkpoints of a run, oldest first."""
    if not run_dir.exists():
        return []
    out = []
    for p in run_dir.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / MARKER).exists():
            out.append(CheckpointRef(p, int(m.group(1))))
    return sorted(out, key=lambda c: c.step)


def latest_complete(run_dir: Path) -> CheckpointRef | None:
    refs = list_complete(run_dir)
    return refs[-1] if refs else None


def _tensors_for_save(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # safetensors refuses shared storage (tied weights): store each tensor on its own.
    seen: dict[int, str] = {}
    out = {}
    for k, v in state.items():
        v = v.detach().cpu()
        ptr = v.untyped_storage().data_ptr()
        out[k] = v.clone() if ptr in seen else v.contiguous()
        seen[ptr] = k
    return out


def save(
    run_dir: Path,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    state: dict[str, Any],
    config: dict[str, Any],
    keep_last: int,
    extra_dirs: dict[str, Path] | None = None,
) -> Path:
    """Write a checkpoint atomically and prune older ones (never the newest complete one).

    A failure while writing (full disk, I/O error) removes the partial folder and raises; the
    previous checkpoints are untouched.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    final = run_dir / step_dir_name(step)
    tmp = run_dir / f".tmp-{step_dir_name(step)}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        save_file(_tensors_for_save(model.state_dict()), str(tmp / "model.safetensors"))
        if optimizer is not None:
            save_file(optimizer_tensors(model, optimizer), str(tmp / "optimizer.safetensors"))
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=2, sort_keys=True))
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        for name, src in (extra_dirs or {}).items():  # committed together with the weights
            os.replace(src, tmp / name)
        for f in tmp.rglob("*"):
            if f.is_file():
                _fsync(f)
        (tmp / MARKER).write_text(str(step))
        _fsync(tmp / MARKER)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        previous = latest_complete(run_dir)
        raise GhostvisError(
            f"checkpoint step {step} could not be written to {run_dir} ({exc.strerror or exc}); "
            f"the previous checkpoint {previous.path.name if previous else '(none)'} is intact; free space "
            "or fix the storage, then re-materialize the stage to resume"
        ) from None
    if final.exists():  # a stale copy of the same step from a run that died after committing
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(run_dir)
    prune(run_dir, keep_last)
    return final


def prune(run_dir: Path, keep_last: int) -> None:
    refs = list_complete(run_dir)
    for ref in refs[: max(0, len(refs) - max(1, keep_last))]:
        shutil.rmtree(ref.path, ignore_errors=True)
    for p in run_dir.glob(".tmp-step_*"):
        shutil.rmtree(p, ignore_errors=True)


def optimizer_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for p, st in optimizer.state.items():
        for k, v in st.items():
            if torch.is_tensor(v):
                out[f"{names[id(p)]}::{k}"] = v.detach().cpu().contiguous()
    return out


def load_model(path: Path, model: torch.nn.Module, *, allow_missing: tuple[str, ...] = ()) -> None:
    """Load weights; parameters under an `allow_missing` prefix may be absent (newly added)."""
    state = load_file(str(_require(path, "model.safetensors")))
    own = model.state_dict()
    wrong = [f"{k} {tuple(v.shape)} vs model {tuple(own[k].shape)}" for k, v in state.items()
             if k in own and own[k].shape != v.shape]
    if wrong:
        raise GhostvisError(
            f"checkpoint {path}: tensor shapes do not fit the model ({'; '.join(wrong[:3])}); the stage config's "
            "model shape must match the checkpoint's config.json"
        )
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith(allow_missing)]
    if missing or unexpected:
        raise GhostvisError(
            f"checkpoint {path}: does not fit the model (missing {missing[:5]}, unexpected {unexpected[:5]}); "
            "the stage config's model shape must match the checkpoint's config.json"
        )


def load_optimizer(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    tensors = load_file(str(_require(path, "optimizer.safetensors")))
    params = dict(model.named_parameters())
    for key, value in tensors.items():
        name, field = key.split("::")
        optimizer.state[params[name]][field] = value.to(params[name].device)


def read_state(path: Path) -> dict[str, Any]:
    """The TrainState saved with a checkpoint, as a dict."""
    return read_json(path, STATE_FILE)


def read_json(path: Path, name: str) -> dict[str, Any]:
    return json.loads(_require(path, name).read_text())


def _require(path: Path, name: str) -> Path:
    f = path / name
    if not f.exists():
        raise GhostvisError(f"checkpoint {path}: {name} is missing; the checkpoint is incomplete, delete {path}")
    return f


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        _fsync(path)
    except OSError:
        pass

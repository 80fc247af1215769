"""Atomic, pickle-free checkpoints, in one of two formats.

<run>/step_000000150/ holds the weights and optimizer state, train_state.json (the TrainState: step,
loader position, token counts, ledger part chain, MLflow run id, RNG states), config.json and a
COMPLETE marker. The weights are either
- model.safetensors + optimizer.safetensors (ddp: rank 0 holds everything and writes them), or
- dcp/: a torch.distributed.checkpoint folder (fsdp: every rank writes its own shard, `save_shards`,
  or in a background thread while training goes on, `start_shards`; the folder is committed only
  when every rank's shard and the metadata are written); its tensors are keyed by parameter name,
  so it loads on any world size (DCP reshards on read), and `export_safetensors` consolidates it
  into one file when someone asks for one.
`load_model` and `load_optimizer` read both.
The COMPLETE marker, written last, records the sha256 of every other file (`write_marker`); `load_model`,
the one way weights leave a checkpoint (resume, init_from, a reference model, evaluation, export),
verifies them first (`verify`), so a flipped byte or a cut file is refused naming the checkpoint, not
trained on or relayed as a safetensors error.
It is written under a temporary name and renamed into place, so a reader that lists step_* folders
with COMPLETE only ever sees finished checkpoints; a crash mid-write leaves a .tmp folder that is
ignored and later removed.
"""

from __future__ import annotations

import json
import os
import pickle  # only to check DCP metadata before DCP unpickles it (_MetadataCheck)
import shutil
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ghostvis_core.errors import GhostvisError
from ghostvis_core.run.train.state import STATE_FILE
from ghostvis_core.store.files import sha256_file
from ghostvis_core.store.layout import is_step_dir, step_dir_name

MARKER = "COMPLETE"
DCP_DIR = "dcp"


@dataclass(frozen=True)
class CheckpointRef:
    path: Path
    step: int


def list_complete(run_dir: Path) -> list[CheckpointRef]:
    """Committed checkpoints of a run, oldest first."""
    if not run_dir.exists():
        return []
    out = []
    for p in run_dir.iterdir():
        if is_step_dir(p.name) and (p / MARKER).exists():
            out.append(CheckpointRef(p, int(p.name.removeprefix("step_"))))
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
    extra_dirs: dict[str, Path] | None = None,
    record_files: Callable[[Path, dict[str, str]], None] | None = None,
) -> Path:
    """Write a checkpoint atomically (pruning the older ones is the CheckpointManager's decision).

    With a `dcp` entry in `extra_dirs` (from `save_shards`) the weights and optimizer state are
    already written, by every rank; they are committed with the rest instead of safetensors.
    `record_files(folder, digests)`, called with the sha256 of every file before the marker is written,
    may add files (the ledger's copy of the digests); the marker hashes only those again.

    A failure while writing (full disk, I/O error) removes the partial folder and raises; the
    previous checkpoints are untouched.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    final = run_dir / step_dir_name(step)
    tmp = run_dir / f".tmp-{step_dir_name(step)}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        if DCP_DIR not in (extra_dirs or {}):
            save_file(_tensors_for_save(model.state_dict()), str(tmp / "model.safetensors"))
        if optimizer is not None and DCP_DIR not in (extra_dirs or {}):
            save_file(optimizer_tensors(model, optimizer), str(tmp / "optimizer.safetensors"))
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=2, sort_keys=True))
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        for name, src in (extra_dirs or {}).items():  # committed together with the weights
            os.replace(src, tmp / name)
        digests = file_digests(tmp)
        if record_files is not None:
            record_files(tmp, digests)
        for f in tmp.rglob("*"):
            if f.is_file():
                _fsync(f)
        write_marker(tmp, step, digests)
    except (OSError, SafetensorError) as exc:  # safetensors reports a full disk as its own error
        shutil.rmtree(tmp, ignore_errors=True)
        previous = latest_complete(run_dir)
        needed = _bytes_needed(model, optimizer, extra_dirs)
        free = shutil.disk_usage(run_dir).free
        raise GhostvisError(
            f"checkpoint step {step} could not be written to {tmp} ({_why(exc)}): it needs about "
            f"{needed:,} bytes and {free:,} are free there; the previous checkpoint "
            f"{previous.path.name if previous else '(none)'} is intact and stays the newest; free space "
            "or fix the storage, then re-materialize the stage to resume"
        ) from None
    if final.exists():  # a stale copy of the same step from a run that died after committing
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(run_dir)
    return final


def _why(exc: Exception) -> str:
    """The system's words for a failed write: 'No space left on device', also inside safetensors' message."""
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    return str(exc).rsplit("I/O error: ", 1)[-1].split(" (os error")[0]


def _bytes_needed(model: torch.nn.Module, optimizer, extra_dirs: dict[str, Path] | None) -> int:
    """The bytes a safetensors checkpoint's weights and optimizer state take (DCP shards are already written)."""
    if DCP_DIR in (extra_dirs or {}):
        return 0
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    if optimizer is not None:
        for per_param in optimizer.state.values():
            total += sum(v.numel() * v.element_size() for v in per_param.values() if torch.is_tensor(v))
    return total


def file_digests(folder: Path, known: dict[str, str] | None = None) -> dict[str, str]:
    """The sha256 of every file of a checkpoint folder but its marker, by path in the folder; the
    `known` ones (hashed already, unchanged since) are not read again."""
    known = known or {}
    return {
        name: known.get(name) or sha256_file(f)
        for f in sorted(folder.rglob("*"))
        if f.is_file() and f.name != MARKER and (name := f.relative_to(folder).as_posix())
    }


def write_marker(folder: Path, step: int, known: dict[str, str] | None = None) -> None:
    """The COMPLETE marker, written last: the step and the sha256 of every file the checkpoint holds, so
    a reader can tell the checkpoint that was committed from one changed, cut or half-uploaded since."""
    files = file_digests(folder, known)
    (folder / MARKER).write_text(json.dumps({"step": step, "sha256": files}, indent=2, sort_keys=True))
    _fsync(folder / MARKER)


class DamagedCheckpoint(GhostvisError):
    """A committed checkpoint whose files are not the ones its marker recorded. `reason` is what is wrong
    with it without its place or the fix: what a resume that passes over it declares in the ledger."""

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason


def verify(path: Path) -> None:
    """Every file the COMPLETE marker lists is there with the sha256 recorded at the commit; raises
    DamagedCheckpoint naming the checkpoint and the files otherwise. Called before anything is loaded."""
    try:
        recorded = json.loads((path / MARKER).read_text())["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        reason = (
            f"its {MARKER} marker records no file hashes (missing, damaged, or written before checkpoints "
            "recorded them)"
        )
        raise DamagedCheckpoint(
            f"checkpoint {path}: {reason}, so its files cannot be verified; delete {path} and re-materialize the "
            "stage that wrote it",
            reason,
        ) from None
    bad = []
    for name, digest in sorted(recorded.items()):
        f = path / name
        if not f.is_file():
            bad.append(f"{name} is missing")
        elif (got := sha256_file(f)) != digest:
            bad.append(f"{name} has sha256 {got[:12]}..., {MARKER} recorded {digest[:12]}...")
    if bad:
        reason = f"{'; '.join(bad[:3])}{f' (and {len(bad) - 3} more)' if len(bad) > 3 else ''}"
        raise DamagedCheckpoint(
            f"checkpoint {path}: {reason}: its files changed since it was committed (a cut copy, a bad disk or an "
            f"edit); delete {path} and re-materialize the stage that wrote it (a resume falls back to the previous "
            "checkpoint)",
            reason,
        )


def verify_recorded(path: Path, recorded: dict[str, str]) -> None:
    """After `verify`: the files are also the ones `recorded` (the digests the checkpoint's ledger part keeps
    in the store's ledger, outside the checkpoint), so a copy that rewrote files and marker together is
    refused as damaged. Compares the marker's digests, which `verify` proved equal to the files."""
    marker = json.loads((path / MARKER).read_text())["sha256"]
    bad = [
        f"{name} has sha256 {marker[name][:12]}..., the ledger recorded {digest[:12]}..."
        if name in marker
        else f"{name} is missing, the ledger recorded it"
        for name, digest in sorted(recorded.items())
        if marker.get(name) != digest
    ]
    if bad:
        reason = f"{'; '.join(bad[:3])}{f' (and {len(bad) - 3} more)' if len(bad) > 3 else ''}"
        raise DamagedCheckpoint(
            f"checkpoint {path}: {reason}: its files and its {MARKER} marker were rewritten together since it was "
            f"committed (a bad copy or an edit); delete {path} and re-materialize the stage that wrote it (a resume "
            "falls back to the previous checkpoint)",
            reason,
        )


def prune(run_dir: Path, keep_last: int) -> list[str]:
    """Remove all but the newest `keep_last` complete checkpoints (never the newest one) and any staging
    folder left by a dead writer; returns the names of the checkpoints removed."""
    refs = list_complete(run_dir)
    gone = refs[: max(0, len(refs) - max(1, keep_last))]
    for ref in gone:
        shutil.rmtree(ref.path, ignore_errors=True)
    for p in [*run_dir.glob(".tmp-step_*"), *run_dir.glob(".dcp-step_*")]:
        shutil.rmtree(p, ignore_errors=True)
    return [ref.path.name for ref in gone]


def _shard_state(
    run_dir: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[Path, dict[str, Any]]:
    """The DCP staging folder of a step and what goes in it: this rank's part of weights and optimizer."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    return run_dir / f".dcp-{step_dir_name(step)}", {"model": model_sd, "optim": optim_sd}


def _shard_error(step: int, staging: Path, exc: BaseException) -> GhostvisError:
    return GhostvisError(
        f"checkpoint step {step}: this rank could not write its shard to {staging} "
        f"({getattr(exc, 'strerror', None) or exc}); free space or fix the storage, then re-materialize"
    )


def save_shards(run_dir: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Path]:
    """Every rank writes its shard of the weights and optimizer state (DCP) into a staging folder;
    the `extra_dirs` entry for `save`, which rank 0 then commits. Called by all ranks together."""
    import torch.distributed.checkpoint as dcp

    staging, state = _shard_state(run_dir, step, model, optimizer)
    try:
        dcp.save(state, checkpoint_id=str(staging))
    except OSError as exc:
        raise _shard_error(step, staging, exc) from None
    return {DCP_DIR: staging}


@dataclass
class ShardsInFlight:
    """An async DCP save (`start_shards`). Its future completes on rank 0 only after DCP has gathered
    every rank's write result and written `.metadata`, so what `wait` returns is safe to commit."""

    step: int
    staging: Path
    future: Future
    group: Any  # the save's own gloo process group (None without a process group)

    def wait(self) -> dict[str, Path]:
        """Block until the shards are written; the `extra_dirs` entry for `save`. Called by all ranks."""
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            self.future.result()
        except (OSError, CheckpointException) as exc:
            raise _shard_error(self.step, self.staging, exc) from None
        finally:
            if self.group is not None:
                torch.distributed.destroy_process_group(self.group)
        return {DCP_DIR: self.staging}


def start_shards(run_dir: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> ShardsInFlight:
    """`save_shards` in a background thread: returns once this rank's shard is copied to CPU memory, so
    training may change the weights while the copy is written. DCP's collectives run on a gloo group
    of the save's own (async DCP needs a CPU backend, and they must never interleave with training's
    collectives on the default group). Called by all ranks together."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    staging, state = _shard_state(run_dir, step, model, optimizer)
    group = dist.new_group(backend="gloo") if dist.is_initialized() else None
    return ShardsInFlight(step, staging, dcp.async_save(state, checkpoint_id=str(staging), process_group=group), group)


def optimizer_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for p, st in optimizer.state.items():
        for k, v in st.items():
            if torch.is_tensor(v):
                out[f"{names[id(p)]}::{k}"] = v.detach().cpu().contiguous()
    return out


def load_model(path: Path, model: torch.nn.Module, *, allow_missing: tuple[str, ...] = ()) -> None:
    """Load weights (either format), once every file is verified against the marker (`verify`);
    parameters under an `allow_missing` prefix may be absent (newly added)."""
    verify(path)
    if (path / DCP_DIR).is_dir():
        return _load_model_dcp(path, model, allow_missing)
    state = load_file(str(_require(path, "model.safetensors")))
    own = model.state_dict()
    wrong = [
        f"{k} {tuple(v.shape)} vs model {tuple(own[k].shape)}"
        for k, v in state.items()
        if k in own and own[k].shape != v.shape
    ]
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


# What a DCP checkpoint's .metadata file (a pickle) may name: DCP's metadata records, torch.Size,
# dtypes, the layout helper and paths. Anything else (os.system, a class with a malicious reduce) is
# refused before the file is unpickled, so loading a DCP checkpoint runs no code from it either.
_DCP_GLOBALS = {
    ("pathlib", "PosixPath"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
}


class _MetadataCheck(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if module == "torch.distributed.checkpoint.metadata" or (module, name) in _DCP_GLOBALS or dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not DCP metadata")


def _reader(path: Path):
    """A DCP FileSystemReader whose metadata is checked against _DCP_GLOBALS before it is loaded."""
    from torch.distributed.checkpoint import FileSystemReader

    class CheckedReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            try:
                with open(path / DCP_DIR / ".metadata", "rb") as f:
                    _MetadataCheck(f).load()
            except (pickle.UnpicklingError, OSError, EOFError) as exc:
                raise GhostvisError(
                    f"checkpoint {path}: {DCP_DIR}/.metadata is not a DCP checkpoint's metadata ({exc}); "
                    f"it was not loaded; delete {path}"
                ) from None
            return super().read_metadata(*args, **kwargs)

    return CheckedReader(str(path / DCP_DIR))


def _dcp_metadata(path: Path) -> dict[str, Any]:
    """Tensor name -> its metadata (size, dtype) in a DCP checkpoint."""
    return _reader(path).read_metadata().state_dict_metadata


def _load_model_dcp(path: Path, model: torch.nn.Module, allow_missing: tuple[str, ...]) -> None:
    """Each rank reads the parts of the saved shards its own parameters need (any world size)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    saved = {k.removeprefix("model."): m for k, m in _dcp_metadata(path).items() if k.startswith("model.")}
    own = get_model_state_dict(model)
    missing = [k for k in own if k not in saved and not k.startswith(allow_missing)]
    unexpected = [k for k in saved if k not in own]
    wrong = [
        f"{k} {tuple(saved[k].size)} vs model {tuple(own[k].shape)}"
        for k in own
        if k in saved and tuple(saved[k].size) != tuple(own[k].shape)
    ]
    if missing or unexpected or wrong:
        raise GhostvisError(
            f"checkpoint {path}: does not fit the model (missing {missing[:5]}, unexpected {unexpected[:5]}, "
            f"shapes {wrong[:3]}); the stage config's model shape must match the checkpoint's config.json"
        )
    wanted = {k: v for k, v in own.items() if k in saved}
    dcp.load({"model": wanted}, storage_reader=_reader(path))
    set_model_state_dict(model, wanted, options=StateDictOptions(strict=False))


def export_safetensors(path: Path, dest: Path) -> Path:
    """Consolidate a DCP checkpoint's weights into one model.safetensors at `dest` (one process,
    no process group): the explicit export step, never done at every save. Verified first, as for `load_model`."""
    import torch.distributed.checkpoint as dcp

    verify(path)
    meta = {k: m for k, m in _dcp_metadata(path).items() if k.startswith("model.")}
    full = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in meta.items()}
    dcp.load(full, storage_reader=_reader(path), no_dist=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    save_file({k.removeprefix("model."): v for k, v in full.items()}, str(dest))
    return dest


def load_optimizer(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    if (path / DCP_DIR).is_dir():
        return _load_optimizer_dcp(path, model, optimizer)
    tensors = load_file(str(_require(path, "optimizer.safetensors")))
    params = dict(model.named_parameters())
    for key, value in tensors.items():
        name, field = key.split("::")
        optimizer.state[params[name]][field] = value.to(params[name].device)


def _load_optimizer_dcp(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_optimizer_state_dict

    _, optim_sd = get_state_dict(model, optimizer)  # the optimizer's own layout (sharded or not), to fill
    dcp.load({"optim": optim_sd}, storage_reader=_reader(path))
    set_optimizer_state_dict(model, optimizer, optim_sd)


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

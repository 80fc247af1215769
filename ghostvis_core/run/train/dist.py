"""torchrun process group and rank-0 helpers (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

import datetime
import os
import signal
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ghostvis_core.errors import GhostvisError


@dataclass(frozen=True)
class DistContext:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def die_with_parent() -> None:
    """torchrun starts each rank in its own session; if torchrun itself is killed (SIGKILL of the
    launcher or of the Dagster step), the ranks would train on as orphans. Linux can tie a rank's
    life to its parent's, so a killed launch stops everywhere and is resumed by the next one."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the parent died before the call above
        os._exit(1)


def setup(timeout_s: float = 0.0) -> DistContext:
    """Join the torchrun process group if there is one; a plain `python -m` run is world size 1. `timeout_s`
    (runtime.hang_timeout_s) bounds every collective; 0 keeps torch's default."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_parent()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        threads = int(os.environ.get("OMP_NUM_THREADS", "0")) or max(1, (os.cpu_count() or 1) // local_world)
        torch.set_num_threads(threads)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            device_id=device if backend == "nccl" else None,
            timeout=datetime.timedelta(seconds=timeout_s) if timeout_s > 0 else None,
        )
    return DistContext(rank, local_rank, world, device)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(values: list[float | int], ctx: DistContext, dtype=torch.float64) -> list:
    """Sum a short list of numbers over ranks (exact for token counts below 2^53)."""
    return summed_on_device(on_device(values, ctx, dtype), ctx).tolist()


def on_device(values: list[float | int], ctx: DistContext, dtype=torch.float64) -> torch.Tensor:
    """Host numbers as a tensor on the run's device without a host wait: on CUDA through pinned memory and a
    non-blocking copy (a copy from pageable memory waits for the device to finish its queued work)."""
    t = torch.tensor(values, dtype=dtype)
    if ctx.device.type != "cuda":
        return t
    return t.pin_memory().to(ctx.device, non_blocking=True)


def summed_on_device(t: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """`t` summed over ranks in place, left on the device: nothing is read back, so the host does not wait."""
    if ctx.world_size > 1:
        dist.all_reduce(t)
    return t


def gather_objects(obj, ctx: DistContext) -> list:
    if ctx.world_size == 1:
        return [obj]
    out: list = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


SAME_STORE = (
    "every node must read the same store: mount the shared filesystem at the same path on every "
    "node, or use GHOSTVIS_STORE=s3://bucket/prefix"
)


def agree(value, ctx: DistContext, what: str, fix: str = SAME_STORE):
    """`value` when every rank has the same one. Each rank finds some things on its own (e.g. the
    newest committed checkpoint to resume from); ranks that see different ones would train on from
    different states without any error, so a difference stops the run here, naming who saw what."""
    values = gather_objects(value, ctx)
    if all(v == values[0] for v in values):
        return value
    seen: dict[str, list[int]] = {}
    for rank, v in enumerate(values):
        seen.setdefault("none" if v is None else str(v), []).append(rank)
    parts = [
        f"{'rank' if len(r) == 1 else 'ranks'} {_ranges(r)} {'sees' if len(r) == 1 else 'see'} {v}"
        for v, r in sorted(seen.items(), key=lambda kv: kv[1][0])
    ]
    raise GhostvisError(f"ranks disagree on {what}: {'; '.join(parts)}; {fix}")


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5' (a 256-rank job stays readable)."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def broadcast_object(obj, ctx: DistContext):
    if ctx.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(ctx: DistContext) -> None:
    if ctx.world_size > 1:
        dist.barrier()


def print0(*args, ctx: DistContext | None = None, **kwargs) -> None:
    if ctx is None or ctx.is_main:
        print(*args, **kwargs, flush=True)

"""A checkpoint and its ledger part, committed together: the part (what the loader delivered since
the last checkpoint, gathered from every rank) is written inside the checkpoint folder, so both
appear at the checkpoint's atomic rename, and is then published into the store's ledger.

DCP shards on a store in a bucket: every rank uploads its own shard into the checkpoint's place
(`share_shard`) before rank 0 publishes the rest with the COMPLETE marker last, so ranks on other
nodes (each with its own cache) need no filesystem shared with rank 0."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ghostvis_core.counts import TokenCounts
from ghostvis_core.data.ledger import Ledger, pieces_to_rows, row_ranges
from ghostvis_core.data.loader import merge_pieces
from ghostvis_core.store import Store
from ghostvis_core.run.train import checkpoint as ckpt
from ghostvis_core.run.train.dist import DistContext, barrier, gather_objects
from ghostvis_core.run.train.run import Run


@dataclass
class Pending:
    """An async checkpoint (checkpoint.async_save) whose shards are still being written."""

    shards: ckpt.ShardsInFlight
    ledger: Path | None  # rank 0: the staging folder of the checkpoint's ledger part
    state: dict[str, Any] | None  # rank 0: the TrainState as of the checkpoint's step


# Per run folder, the checkpoint in flight: the next `commit` settles it before anything else, and the
# run's last checkpoint is settled at once, so its marker is written after all of its data and before
# the next checkpoint or the end of the run.
_in_flight: dict[Path, Pending] = {}


def commit(run: Run) -> None:
    settle(run)
    s = run.state
    c = run.consumption
    gathered = gather_objects((c.pieces, c.counts, c.rows, run.fed.records(run.ctx.rank)), run.ctx)
    rollouts = [r for rs in gather_objects(run.rollouts.records(run.ctx.rank), run.ctx) for r in rs]
    drop_stale_shards(run.run_dir, run.ctx.rank)  # every earlier checkpoint is committed by now
    part_id = f"{run.spec.run_key}.s{s.segment:03d}.p{s.step:09d}"
    # DCP (fsdp, or any strategy with async_save): every rank writes its shard first; rank 0 commits them
    async_save = run.cfg.checkpoint.async_save
    in_flight = ckpt.start_shards(run.run_dir, s.step, run.model, run.optimizer) if async_save else None
    shards = (ckpt.save_shards(run.run_dir, s.step, run.model, run.optimizer)
              if run.cfg.parallel.strategy == "fsdp" and not async_save else {})
    if shards:
        share_shard(run.store, run.ctx, run.spec.stage, run.spec.run_key, s.step, shards[ckpt.DCP_DIR])
    staging = state = None
    if run.ctx.is_main:
        staging = run.run_dir / f".ledger-{part_id}"
        write_part(run, staging, part_id, gathered, rollouts)
        s.head_part_id = part_id
        s.mlflow_run_id = run.tracker.run_id()
        s.capture_rng()
        state = s.to_dict()
    s.head_part_id = part_id
    if in_flight is not None:
        _in_flight[run.run_dir] = Pending(in_flight, staging, state)
        if s.step == run.total_steps:
            settle(run)
    elif run.ctx.is_main:
        save_and_publish(run, s.step, state, {"ledger": staging, **shards})
    barrier(run.ctx)


def settle(run: Run) -> None:
    """Commit the async checkpoint in flight, if any: every rank waits for its shard; rank 0 then
    writes the state, config and ledger part beside the shards, the COMPLETE marker last."""
    pending = _in_flight.pop(run.run_dir, None)
    if pending is None:
        return
    shards = pending.shards.wait()
    share_shard(run.store, run.ctx, run.spec.stage, run.spec.run_key, pending.shards.step, shards[ckpt.DCP_DIR])
    if run.ctx.is_main:
        save_and_publish(run, pending.shards.step, pending.state, {"ledger": pending.ledger, **shards})


def share_shard(store: Store, ctx: DistContext, stage: str, run_key: str, step: int, staging: Path) -> None:
    """Called by every rank once its DCP shard is written. On a store in a bucket the rank uploads its
    own shard file(s) into the checkpoint's place, rank 0 also DCP's `.metadata` (which `publish`, skipping
    hidden names, would leave out); a folder store needs nothing: every rank wrote into the same folder.
    The barrier then holds rank 0's marker until every shard is in the store."""
    if not store.shared_folder:
        own = [*staging.glob(f"__{ctx.rank}_*.distcp"), *([staging / ".metadata"] if ctx.is_main else [])]
        for f in sorted(own):
            store.put_file("checkpoint", stage, run_key, f"{ckpt.step_dir_name(step)}/{ckpt.DCP_DIR}/{f.name}", src=f)
    barrier(ctx)


def drop_stale_shards(run_dir: Path, rank: int) -> None:
    """This rank's shard files left in staging folders of committed checkpoints: on rank 0's node the
    folders were renamed into the checkpoints, on another node (its own cache) they were uploaded."""
    for folder in run_dir.glob(".dcp-step_*"):
        for f in folder.glob(f"__{rank}_*.distcp"):
            f.unlink(missing_ok=True)
        try:
            folder.rmdir()  # empty once every rank of this node has removed its file
        except OSError:
            pass


def save_and_publish(run: Run, step: int, state: dict[str, Any], extra_dirs: dict[str, Path]) -> None:
    """Rank 0: the checkpoint folder (safetensors, or the DCP shards in `extra_dirs`), then the store."""
    before = {c.path.name for c in ckpt.list_complete(run.run_dir)}
    path = ckpt.save(run.run_dir, step, model=run.model, optimizer=run.optimizer, state=state,
                     config=run.spec.config, keep_last=run.cfg.checkpoint.keep_last, extra_dirs=extra_dirs)
    share_checkpoint(run, path.name, before)
    publish_parts(run.store, run.run_dir, only=path)


def share_checkpoint(run: Run, name: str, before: set[str]) -> None:
    """Publish the new checkpoint (its COMPLETE marker last) and drop the ones `save` pruned here."""
    key = (run.spec.stage, run.spec.run_key)
    run.store.publish("checkpoint", *key, name)
    for gone in before - {c.path.name for c in ckpt.list_complete(run.run_dir)}:
        run.store.delete("checkpoint", *key, gone)


def write_part(run: Run, folder: Path, part_id: str, gathered: list, rollouts: list[dict[str, Any]]) -> None:
    """The ledger part of the steps since the last checkpoint, from every rank's (pieces, counts, rows,
    feeds): the part row sums them, and each rank's share and content digests are kept beside it, so a
    rank whose rows, counts or content went wrong is visible rather than hidden in the sum. An rl run's
    rollouts (every rank's completions and rewards per step) go beside them."""
    pieces = [p for ps, _, _, _ in gathered for p in ps]
    counts = TokenCounts.total(c for _, c, _, _ in gathered)
    merged, overlap = merge_pieces(pieces)
    shares = [{"rank": rank, "world_size": run.ctx.world_size, "row_count": len(rows),
               "row_ranges": json.dumps(row_ranges(rows)), **c.as_dict()}
              for rank, (_, c, rows, _) in enumerate(gathered)]
    feeds = [f for _, _, _, fs in gathered for f in fs]
    Ledger(folder).write_part(part_record(run, part_id, counts, overlap), pieces_to_rows(merged, run.objective.rows_of),
                              shares, feeds, rollouts or None)


def part_record(run: Run, part_id: str, counts: TokenCounts, overlap: int) -> dict[str, Any]:
    s, p, spec = run.state, run.plan, run.spec
    return {
        "part_id": part_id, "prev_part_id": s.head_part_id or "", "run_key": spec.run_key,
        "parent_run_key": spec.parent_run_key or "", "stage": spec.stage, "segment": s.segment,
        "step_first": run.part_first[0] + 1, "step_last": s.step,
        "rows_first": run.part_first[1], "rows_last": s.rows,
        **counts.as_dict(), "overlap_tokens": overlap,
        "micro_batch_size": p.micro_batch_size, "seq_len": p.seq_len,
        "world_size": p.world_size, "grad_accum_steps": p.grad_accum_steps,
        "tokens_per_step": p.tokens_per_step, "planned_tokens": int(spec.plan["planned_tokens"]),
        "allow_repeat": run.cfg.data.allow_repeat, "replay_sources": json.dumps(run.cfg.data.replay_sources),
        "mlflow_run_id": run.tracker.run_id(),
    }


def publish_parts(store: Store, run_dir: Path, only: Path | None = None) -> None:
    """Copy committed checkpoints' ledger parts into the store's ledger (idempotent: same names)."""
    refs = [only] if only else [r.path for r in ckpt.list_complete(run_dir)]
    for path in refs:
        for f in (path / "ledger").rglob("*.parquet"):
            store.put_file("ledger_file", f.relative_to(path / "ledger").as_posix(), src=f)

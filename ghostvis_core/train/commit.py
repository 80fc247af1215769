"""A checkpoint and its ledger part, committed together: the part (what the loader delivered since
the last checkpoint, gathered from every rank) is written inside the checkpoint folder, so both
appear at the checkpoint's atomic rename, and is then published into the store's ledger."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ghostvis_core.counts import TokenCounts
from ghostvis_core.data.ledger import Ledger, pieces_to_rows, row_ranges
from ghostvis_core.data.loader import merge_pieces
from ghostvis_core.store import LocalStore
from ghostvis_core.train import checkpoint as ckpt
from ghostvis_core.train.dist import barrier, gather_objects
from ghostvis_core.train.run import Run


def commit(run: Run) -> None:
    s = run.state
    c = run.consumption
    gathered = gather_objects((c.pieces, c.counts, c.rows), run.ctx)
    part_id = f"{run.spec.run_key}.s{s.segment:03d}.p{s.step:09d}"
    # fsdp: every rank writes its shard of weights and optimizer state first; rank 0 commits them
    shards = ckpt.save_shards(run.run_dir, s.step, run.model, run.optimizer) if run.cfg.parallel.strategy == "fsdp" else {}
    if run.ctx.is_main:
        staging = run.run_dir / f".ledger-{part_id}"
        write_part(run, staging, part_id, gathered)
        s.head_part_id = part_id
        s.mlflow_run_id = run.tracker.run_id()
        s.capture_rng()
        before = {c.path.name for c in ckpt.list_complete(run.run_dir)}
        path = ckpt.save(run.run_dir, s.step, model=run.model, optimizer=run.optimizer, state=s.to_dict(),
                         config=run.spec.config, keep_last=run.cfg.checkpoint.keep_last,
                         extra_dirs={"ledger": staging, **shards})
        share_checkpoint(run, path.name, before)
        publish_parts(run.store, run.run_dir, only=path)
    s.head_part_id = part_id
    barrier(run.ctx)


def share_checkpoint(run: Run, name: str, before: set[str]) -> None:
    """Publish the new checkpoint (its COMPLETE marker last) and drop the ones `save` pruned here."""
    key = (run.spec.stage, run.spec.run_key)
    run.store.publish("checkpoint", *key, name)
    for gone in before - {c.path.name for c in ckpt.list_complete(run.run_dir)}:
        run.store.delete("checkpoint", *key, gone)


def write_part(run: Run, folder: Path, part_id: str, gathered: list) -> None:
    """The ledger part of the steps since the last checkpoint, from every rank's (pieces, counts, rows):
    the part row sums them, and each rank's share is kept beside it, so a rank whose rows or counts
    went missing is visible rather than hidden in the sum."""
    pieces = [p for ps, _, _ in gathered for p in ps]
    counts = TokenCounts.total(c for _, c, _ in gathered)
    merged, overlap = merge_pieces(pieces)
    shares = [{"rank": rank, "world_size": run.ctx.world_size, "row_count": len(rows),
               "row_ranges": json.dumps(row_ranges(rows)), **c.as_dict()}
              for rank, (_, c, rows) in enumerate(gathered)]
    Ledger(folder).write_part(part_record(run, part_id, counts, overlap), pieces_to_rows(merged, run.objective.rows_of),
                              shares)


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


def publish_parts(store: LocalStore, run_dir: Path, only: Path | None = None) -> None:
    """Copy committed checkpoints' ledger parts into the store's ledger (idempotent: same names)."""
    refs = [only] if only else [r.path for r in ckpt.list_complete(run_dir)]
    for path in refs:
        for f in (path / "ledger").rglob("*.parquet"):
            store.put_file("ledger_file", f.relative_to(path / "ledger").as_posix(), src=f)

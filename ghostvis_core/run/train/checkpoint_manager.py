"""CheckpointManager: the one owner of a run's checkpoints in the store: resume (the newest committed
checkpoint), commit (a checkpoint and its ledger part together), prune (`checkpoint.keep_last`) and the
async save in flight. `checkpoint.py` is the on-disk format it writes and reads.

The commit protocol: the ledger part (what the loader delivered since the last checkpoint, gathered from
every rank) is written inside the checkpoint folder, so both appear at the checkpoint's atomic rename; the
checkpoint is then published to the store with its COMPLETE marker last, and the part copied into the
store's ledger. A resume republishes every committed checkpoint's part (idempotent), so a part is never
lost to a crash between the marker and its copy.

DCP shards on a store in a bucket: every rank uploads its own shard into the checkpoint's place
(`share_shard`) before rank 0 publishes the rest with the COMPLETE marker last, so ranks on other nodes
(each with its own cache) need no filesystem shared with rank 0.

Fencing: rank 0 grants each checkpoint through the run's lease once its COMPLETE marker is in the store
(store/fence.py), before its ledger part is copied into the store's ledger; a refused grant removes the
checkpoint and stops every rank (`LeaseLost`). A resume passes over a checkpoint whose marker no granted commit
names: a launch that lost the lease wrote it."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ghostvis_core.counts import TokenCounts
from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.ledger.records import PartRow, RolloutRow, ShareRow
from ghostvis_core.data.ledger.write import pieces_to_rows, row_ranges
from ghostvis_core.data.loader import Batch, Consumption, merge_pieces
from ghostvis_core.data.shard_piece import Piece
from ghostvis_core.errors import GhostvisError
from ghostvis_core.run.train import checkpoint as ckpt
from ghostvis_core.run.train.dist import DistContext, agree, barrier, broadcast_object, gather_objects, print0
from ghostvis_core.run.train.feeds import FedLog
from ghostvis_core.run.train.grpo import RolloutLog
from ghostvis_core.run.train.state import TrainState
from ghostvis_core.run.train.timeline import Timeline
from ghostvis_core.runs.launch_spec import LaunchSpec
from ghostvis_core.runs.lookup import identity_of
from ghostvis_core.store import Store
from ghostvis_core.store.fence import Grants, LeaseLost, grants
from ghostvis_core.store.layout import is_step_dir, step_dir_name
from ghostvis_core.store.lease import Lease


@dataclass
class PartLog:
    """What this rank delivered since the last checkpoint, the content of the next ledger part: where it
    began (step, loader rows), the consumption, the content digests and an rl run's rollouts."""

    first_step: int
    first_rows: int
    rows_of: Callable[[Piece], tuple[int, int]]  # the objective's shard rows of a piece
    consumption: Consumption = field(default_factory=Consumption)
    fed: FedLog = field(default_factory=FedLog)
    rollouts: RolloutLog = field(default_factory=RolloutLog)

    def feed(self, step: int, batch: Batch) -> None:
        """A micro-batch about to go to the model, all its accounting in one call: its content digests (taken at
        the model's input), its rollouts and its consumption (pieces, counts and rows). Nothing of a step is
        committed before the step ends, so what is recorded before its forward is what the step trained."""
        self.fed.expect(step, batch)
        self.rollouts.add(step, batch)
        self.consumption.add(batch)


@dataclass
class Pending:
    """An async checkpoint (checkpoint.async_save) whose shards are still being written."""

    shards: ckpt.ShardsInFlight
    ledger: Path | None  # rank 0: the staging folder of the checkpoint's ledger part
    state: dict[str, Any] | None  # rank 0: the TrainState as of the checkpoint's step


class CheckpointManager:
    """One run's checkpoints, on every rank. The async checkpoint in flight is settled by the next
    `commit` before anything else, and the run's last checkpoint at once, so its marker is written after
    all of its data and before the next checkpoint or the end of the run."""

    def __init__(
        self,
        store: Store,
        spec: LaunchSpec,
        ctx: DistContext,
        *,
        keep_last: int,
        async_save: bool,
        sharded: bool,
        lease: Lease | None = None,
    ):
        self.store, self.spec, self.ctx = store, spec, ctx
        self.keep_last, self.async_save, self.sharded = keep_last, async_save, sharded
        self.lease = lease  # rank 0's: grants each checkpoint (None: nothing to fence with)
        self.ungranted: set[str] = set()  # checkpoints a launch that lost the lease left: never resumed from
        self.run_dir = store.writable("checkpoints", spec.stage, spec.run_key)
        self._pending: Pending | None = None
        # the damaged checkpoints `newest` passed over, newest first: {checkpoint, step, reason} each, declared
        # in every ledger part of this segment, so the steps trained again are accounted, not taken for reuse
        self.passed_over: list[dict[str, Any]] = []
        self.timeline: Timeline | None = None  # rank 0's: its rows since the last commit go into each part

    def newest(self) -> ckpt.CheckpointRef | None:
        """The run's newest committed checkpoint whose files verify against its marker (`ckpt.verify`),
        fetched to this node from the store, the same on every rank, and whose files are also the ones its
        ledger part recorded in the store's ledger (`ckpt.verify_recorded`; a checkpoint whose part is not
        published yet has only its marker to go by). A damaged one is named and passed
        over for the one before it: the steps after that one are trained again, and `passed_over` says which
        checkpoint and why (the ledger's reuse accounting declares those steps retrained after a fallback);
        when none verifies the run stops rather than start over on a run that has trained."""
        keys = self.store.keys("checkpoint_marker", self.spec.stage, self.spec.run_key)
        in_store = {k[2] for k in keys if is_step_dir(k[2])}
        local = {r.path.name for r in ckpt.list_complete(self.run_dir)}
        fenced = grants(self.store, self.spec.stage, identity_of(self.spec.run_key))
        self.ungranted = self.not_granted(in_store | local, fenced)
        in_store, local = in_store - self.ungranted, local - self.ungranted
        ref = None
        for name in sorted(in_store | local, reverse=True):
            step = int(name.removeprefix("step_"))
            if name in in_store:
                self.store.fetch("checkpoint", self.spec.stage, self.spec.run_key, name)
            try:
                ckpt.verify(self.run_dir / name)
                ckpt.verify_recorded(
                    self.run_dir / name, Ledger.in_store(self.store).checkpoint_files(self.spec.run_key, step)
                )
            except ckpt.DamagedCheckpoint as exc:
                print0(f"[{self.spec.stage}] not resuming from it: {exc}", ctx=self.ctx)
                self.passed_over.append({"checkpoint": name, "step": step, "reason": exc.reason})
                continue
            ref = ckpt.CheckpointRef(self.run_dir / name, step)
            break
        if ref is None and in_store | local:
            raise GhostvisError(
                f"run {self.spec.run_key}: none of its {len(in_store | local)} committed checkpoints in "
                f"{self.run_dir} verifies against its {ckpt.MARKER} marker (see above); delete the run's "
                f"checkpoints folder to train it from the start, or restore them from a copy"
            )
        agree(ref.step if ref else None, self.ctx, f"the checkpoint step to resume from in {self.run_dir}")
        return ref

    def not_granted(self, names: set[str], found: Grants | None) -> set[str]:
        """The checkpoints among `names` whose COMPLETE marker no granted commit of the run's fence log names (a
        launch that lost the lease wrote them after the takeover); rank 0 removes them, so the steps they hold
        are trained again by the holder. Nothing when the run was never fenced."""
        if found is None:
            return set()
        key = (self.spec.stage, self.spec.run_key)
        out = set()
        for name in sorted(names):
            marker = self.run_dir / name / ckpt.MARKER
            try:
                text = marker.read_text() if marker.exists() else self.store.read_text("checkpoint_marker", *key, name)
            except (GhostvisError, FileNotFoundError):  # removed meanwhile
                continue
            if not found.covers("checkpoint_marker", *key, name, text=text):
                out.add(name)
                print0(
                    f"[{self.spec.stage}] not resuming from {name}: no granted commit under the run's lease "
                    "names it (a launch that lost the lease wrote it); removed",
                    ctx=self.ctx,
                )
                if self.ctx.is_main:
                    self.store.delete("checkpoint", *key, name)
        return out

    def load_model(self, ref: ckpt.CheckpointRef, model: torch.nn.Module) -> TrainState:
        """The weights and the TrainState of a checkpoint to resume from; the committed checkpoints' ledger
        parts are published again (a crash may have come between a marker and its part's copy)."""
        ckpt.load_model(ref.path, model)
        self.publish_parts()
        return TrainState.from_dict(ckpt.read_state(ref.path))

    def committed_counts(self) -> list[tuple[int, TokenCounts]]:
        """Rank 0: (step, cumulative token counts) at each committed checkpoint of this run, from the ledger (what
        a resumed segment logs to MLflow again); nothing on other ranks."""
        if not self.ctx.is_main:
            return []
        out, total = [], TokenCounts()
        for part in Ledger.in_store(self.store).chain(self.spec.run_key):
            total = total + part.counts
            out.append((part.step_last, total))
        return out

    def load_optimizer(self, ref: ckpt.CheckpointRef, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        ckpt.load_optimizer(ref.path, model, optimizer)

    def commit(
        self,
        state: TrainState,
        part: PartLog,
        record: PartRow | None,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        final: bool,
    ) -> None:
        """Checkpoint `state` (rank 0's is saved) with the ledger part of `part` gathered from every rank;
        `record` is rank 0's part row without the counts (the sums of what is gathered). Called by all ranks."""
        self.settle()
        c = part.consumption
        ids = (state.head_part_id, self.spec.run_key, self.ctx.rank)  # the part's row keys, this rank's
        gathered = gather_objects((c.pieces, c.counts, c.rows, part.fed.records(*ids)), self.ctx)
        rollouts = [r for rs in gather_objects(part.rollouts.records(*ids), self.ctx) for r in rs]
        drop_stale_shards(self.run_dir, self.ctx.rank)  # every earlier checkpoint is committed by now
        step = state.step
        # DCP (fsdp, or any strategy with async_save): every rank writes its shard first; rank 0 commits them
        in_flight = ckpt.start_shards(self.run_dir, step, model, optimizer) if self.async_save else None
        shards = ckpt.save_shards(self.run_dir, step, model, optimizer) if self.sharded and not self.async_save else {}
        if shards:
            self.share_shard(step, shards[ckpt.DCP_DIR])
        staging = saved = None
        if self.ctx.is_main:
            staging = self.run_dir / f".ledger-{record.part_id}"
            write_part(staging, record, gathered, rollouts, part.rows_of, self.ctx.world_size)
            if self.timeline is not None:
                Ledger(staging).write_timeline(self.timeline.part_rows(step), f"p{step:09d}")
            saved = state.to_dict()
        if in_flight is not None:
            self._pending = Pending(in_flight, staging, saved)
            if final:
                self.settle()
            barrier(self.ctx)
        else:
            self._on_main(lambda: self._save_and_publish(step, saved, {"ledger": staging, **shards}, model, optimizer))

    def settle(self) -> None:
        """Commit the async checkpoint in flight, if any: every rank waits for its shard; rank 0 then writes
        the state, config and ledger part beside the shards, the COMPLETE marker last."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        shards = pending.shards.wait()
        self.share_shard(pending.shards.step, shards[ckpt.DCP_DIR])
        extra = {"ledger": pending.ledger, **shards}
        self._on_main(lambda: self._save_and_publish(pending.shards.step, pending.state, extra))

    def _on_main(self, commit: Callable[[], None]) -> None:
        """Rank 0 commits while every rank waits; a lease lost there stops every rank (`LeaseLost` on each)."""
        lost = None
        if self.ctx.is_main:
            try:
                commit()
            except LeaseLost as exc:
                lost = str(exc)
        lost = broadcast_object(lost, self.ctx)
        if lost:
            raise LeaseLost(lost)

    def settle_all(self) -> int | None:
        """Called by all ranks when the run stops before its end (a preemption): the async checkpoint in flight
        is committed, then every rank reads the newest committed step from the store."""
        self.settle()
        barrier(self.ctx)
        return self.committed_step()

    def committed_step(self) -> int | None:
        """The step of the run's newest checkpoint whose COMPLETE marker is in the store (None: none yet), read
        from the store, so what a preemption reports is what a resume will find."""
        keys = self.store.keys("checkpoint_marker", self.spec.stage, self.spec.run_key)
        steps = [int(k[2].removeprefix("step_")) for k in keys if is_step_dir(k[2])]
        return max(steps, default=None)

    def share_shard(self, step: int, staging: Path) -> None:
        share_shard(self.store, self.ctx, self.spec.stage, self.spec.run_key, step, staging)

    def _save_and_publish(
        self,
        step: int,
        state: dict[str, Any],
        extra_dirs: dict[str, Path],
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        """Rank 0: the checkpoint folder (safetensors from `model` and `optimizer`, or the DCP shards in
        `extra_dirs`), then the store, marker last, then its ledger part into the store's ledger."""
        path = ckpt.save(
            self.run_dir,
            step,
            model=model,
            optimizer=optimizer,
            state=state,
            config=self.spec.config.to_dict(),
            extra_dirs=extra_dirs,
            record_files=functools.partial(record_in_ledger, step=step),
        )
        self.publish(path)
        self.grant(path)
        self.prune()
        self.publish_parts(only=path)

    def grant(self, path: Path) -> None:
        """Rank 0: the checkpoint's commit granted through the run's lease, now that its marker is in the store;
        refused (`LeaseLost`: another launch holds the run now), the checkpoint is removed again."""
        if self.lease is None:
            return
        key = (self.spec.stage, self.spec.run_key, path.name)
        try:
            self.lease.commit("checkpoint_marker", *key, text=self.store.read_text("checkpoint_marker", *key))
        except LeaseLost:
            self.store.delete("checkpoint", *key)
            raise

    def publish(self, path: Path) -> None:
        """The committed folder into the store, its marker last; a refused or failed upload is an error naming
        the checkpoint and the store's newest committed one, which it leaves the newest."""
        key = (self.spec.stage, self.spec.run_key)
        try:
            self.store.publish("checkpoint", *key, path.name)
        except GhostvisError:
            raise
        except Exception as exc:
            committed = sorted(k[2] for k in self.store.keys("checkpoint_marker", *key) if k[2] != path.name)
            raise GhostvisError(
                f"checkpoint {path.name} of run {self.spec.run_key}: the upload to "
                f"{self.store.uri_of('checkpoint', *key, path.name)} failed ({type(exc).__name__}: {exc}); its "
                f"COMPLETE marker goes last, so the store's newest committed checkpoint is still "
                f"{committed[-1] if committed else '(none)'}; fix the store's permissions or space, then "
                "re-materialize the stage to resume"
            ) from None

    def prune(self) -> None:
        """Keep the newest `keep_last` committed checkpoints, here and in the store (after a publish, so the
        newest one is never the only copy removed)."""
        for gone in ckpt.prune(self.run_dir, self.keep_last):
            self.store.delete("checkpoint", self.spec.stage, self.spec.run_key, gone)

    def publish_parts(self, only: Path | None = None) -> None:
        """Copy committed checkpoints' ledger parts into the store's ledger (idempotent: same names); not a
        damaged one's, whose copy could be damaged too (the store's ledger keeps what it published)."""
        damaged = {p["checkpoint"] for p in self.passed_over} | self.ungranted
        refs = [only] if only else [r.path for r in ckpt.list_complete(self.run_dir) if r.path.name not in damaged]
        for path in refs:
            for f in (path / "ledger").rglob("*.parquet"):
                self.store.put_file("ledger_file", f.relative_to(path / "ledger").as_posix(), src=f)


def record_in_ledger(folder: Path, digests: dict[str, str], step: int) -> None:
    """The sha256 of the checkpoint's files (but its ledger part's own) into the ledger part it commits
    (`folder`/ledger), which is published to the store's ledger: the copy a load checks outside the checkpoint."""
    ledger = Ledger(folder / "ledger")
    (part,) = ledger.parts()
    ledger.write_checkpoint_files(part, step, {f: d for f, d in digests.items() if not f.startswith("ledger/")})


def share_shard(store: Store, ctx: DistContext, stage: str, run_key: str, step: int, staging: Path) -> None:
    """Called by every rank once its DCP shard is written. On a store in a bucket the rank uploads its
    own shard file(s) into the checkpoint's place, rank 0 also DCP's `.metadata` (which `publish`, skipping
    hidden names, would leave out); a folder store needs nothing: every rank wrote into the same folder.
    The barrier then holds rank 0's marker until every shard is in the store."""
    if not store.shared_folder:
        own = [*staging.glob(f"__{ctx.rank}_*.distcp"), *([staging / ".metadata"] if ctx.is_main else [])]
        for f in sorted(own):
            store.put_file("checkpoint", stage, run_key, f"{step_dir_name(step)}/{ckpt.DCP_DIR}/{f.name}", src=f)
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


def write_part(
    folder: Path,
    record: PartRow,
    gathered: list,
    rollouts: list[RolloutRow],
    rows_of: Callable[[Piece], tuple[int, int]],
    world_size: int,
) -> None:
    """The ledger part of the steps since the last checkpoint, from every rank's (pieces, counts, rows,
    feeds): the part row sums them, and each rank's share and content digests are kept beside it, so a
    rank whose rows, counts or content went wrong is visible rather than hidden in the sum. An rl run's
    rollouts (every rank's completions and rewards per step) go beside them."""
    pieces = [p for ps, _, _, _ in gathered for p in ps]
    counts = TokenCounts.total(c for _, c, _, _ in gathered)
    merged, overlap = merge_pieces(pieces)
    shares = [
        ShareRow(record.part_id, record.run_key, rank, world_size, len(rows), row_ranges(rows), **c.as_dict())
        for rank, (_, c, rows, _) in enumerate(gathered)
    ]
    feeds = [f for _, _, _, fs in gathered for f in fs]
    Ledger(folder).write_part(
        dataclasses.replace(record, **counts.as_dict(), overlap_tokens=overlap),
        pieces_to_rows(record, merged, rows_of),
        shares,
        feeds,
        rollouts or None,
    )

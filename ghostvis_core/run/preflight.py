"""The pre-flight, in the training job (rank 0, before the first step): it builds the stage's objective,
whose streams read the token shards, so it runs where the shards are read anyway and not on the host
that plans and launches the run (Dagster's, which only writes the launch spec).

A refusal is a GhostvisError: the job records it as its reason (runs/reasons.py) and every launcher
fails the materialization with it. What the pre-flight found (the per-source budget, or the refusal)
is a record of its own beside the run (runs/preflight_findings.py); the launch spec is never written again.
"""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING

from ghostvis_core.data.ledger import Ledger
from ghostvis_core.errors import GhostvisError
from ghostvis_core.plan.budget import detected_gpu, memory_plan, memory_refusal, shortfall
from ghostvis_core.runs.launch_spec import LaunchSpec
from ghostvis_core.runs.preflight_findings import PreflightRecord, SourceBudget
from ghostvis_core.store import Store

if TYPE_CHECKING:
    from ghostvis_core.data.stream import SourceStream
    from ghostvis_core.plan.budget import Plan
    from ghostvis_core.plan.config import StageConfig


def check_run(spec: LaunchSpec, store: Store) -> PreflightRecord:
    """Refuse a run whose streams mix splits, whose budget needs more tokens than its shards hold (without
    data.allow_repeat) or whose memory plan does not fit this machine's GPU; else record its per-source budget
    (what the materialization shows as `source_budget`)."""
    # the objective (torch) here, in the job: the Dagster process imports this module's record to read it
    from ghostvis_core.run.train.objectives import build_objective

    pid, host = os.getpid(), socket.gethostname()
    try:
        objective = build_objective(spec, spec.config)
        check_stream_splits(Ledger.in_store(store), spec.tokenizer_id, objective)
        found = PreflightRecord(pid, host, preflight(spec.config, spec.plan, objective))
    except GhostvisError as exc:
        PreflightRecord(pid, host, refused=str(exc)).save(store, spec.stage, spec.run_key)
        raise
    found.save(store, spec.stage, spec.run_key)
    return found


def stream_split_problems(splits: dict[str, str], streams: dict[str, dict[str, SourceStream]]) -> list[str]:
    """For `streams` (split -> source -> the SourceStream an objective will read), every shard whose split
    in the ledger's shard table (`splits`, `Ledger.shard_splits`) is not the stream's: looked up by shard
    id there, never in the shard ref's own label, so a validation shard merged into a train stream
    under a `train` label is named."""
    out = []
    for want, by_source in streams.items():
        for source, stream in sorted(by_source.items()):
            for ref in stream.refs:
                have = splits.get(ref.shard_id, "not in the ledger")
                if have != want:
                    out.append(f"shard {ref.shard_id} (ledger split: {have}) is in the {want} stream of {source}")
    return out


def check_stream_splits(ledger: Ledger, tokenizer_id: str, objective) -> None:
    """Before launch: the objective's train streams hold only train shards and its validation streams
    only validation shards, by the ledger's shard table (what the ranks will read, not what was selected)."""
    problems = stream_split_problems(
        ledger.shard_splits(tokenizer_id), {"train": objective.train_streams, "validation": objective.val_streams}
    )
    if problems:
        raise GhostvisError(
            "stream composition: " + "; ".join(problems) + "; a stream must hold only shards of "
            "its split: fix the objective's streams (built from the launch spec's train_shards and "
            "val_shards) or the shard's split pin in its manifest, then re-launch"
        )


def preflight(cfg: StageConfig, p: Plan, objective) -> dict[str, SourceBudget]:
    """Per source: tokens the budget needs vs tokens available. Refuses to start on a shortfall, and
    on a CUDA machine a config whose memory plan does not fit its GPU (naming the fixes)."""
    device = detected_gpu()
    if device is not None:
        mp = memory_plan(cfg, gpu=device[0], gpu_memory_gb=device[1])
        if not mp.fit.fits:
            raise GhostvisError(memory_refusal(cfg.stage, mp))
    rows = objective.batcher.rows_per_source(p.steps * p.batch.rows_per_step)
    report, problems = {}, []
    for rs in objective.batcher.sources:
        needed, available = rs.tokens_for_rows(rows[rs.source]), rs.available_tokens
        shards = len(objective.train_streams[rs.source].refs)
        epochs = needed / max(1, available)
        report[rs.source] = SourceBudget(needed, available, shards, round(epochs, 3))
        if needed > available and not cfg.data.allow_repeat:
            problems.append(shortfall(rs.source, needed, available, shards))
    if problems:
        raise GhostvisError("pre-flight failed: " + "; ".join(problems))
    return report

"""The pre-flight, in the training job (rank 0, before the first step): it builds the stage's objective,
whose streams read the token shards, so it runs where the shards are read anyway and not on the host
that plans and launches the run (Dagster's, which only writes the launch spec).

A refusal is a GhostvisError: the job records it as its reason (train/reasons.py) and every launcher
fails the materialization with it. What the pre-flight found (the per-source budget, or the refusal)
is a record of its own beside the run (run/preflight_record.py); the launch spec is never written again.
"""

from __future__ import annotations

import os
import socket

from ghostvis_core.data.ledger import Ledger
from ghostvis_core.errors import GhostvisError
from ghostvis_core.run.launch import check_stream_splits, preflight
from ghostvis_core.run.preflight_record import PreflightRecord
from ghostvis_core.run.train.spec import LaunchSpec
from ghostvis_core.store import Store


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

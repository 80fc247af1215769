"""The pre-flight, in the training job (rank 0, before the first step): it builds the stage's objective,
which fetches the token shards and reads their rows, so it runs where the shards are read anyway and
not on the host that plans and launches the run (Dagster's, which only writes the launch spec).

A refusal is a GhostvisError: the job records it as its reason (train/reasons.py) and every launcher
fails the materialization with it. What the pre-flight found (the per-source budget, or the refusal)
is kept beside the run with the process that found it, as `runs/<stage>/<run_key>/preflight.json`.
"""

from __future__ import annotations

import os
import socket
from dataclasses import asdict

from ghostvis_core.data.ledger import Ledger
from ghostvis_core.errors import GhostvisError
from ghostvis_core.run.launch import check_stream_splits, preflight, with_local_shards
from ghostvis_core.run.train.spec import LaunchSpec
from ghostvis_core.store import Store

PREFLIGHT_FILE = "preflight.json"  # a run_file: {"pid", "host", "source_budget"} or {"pid", "host", "refused"}


def check_run(spec: LaunchSpec, store: Store) -> LaunchSpec:
    """Refuse a run whose streams mix splits, whose budget needs more tokens than its shards hold (without
    data.allow_repeat) or whose memory plan does not fit this machine's GPU; else save the spec again
    with its per-source budget (what the materialization shows as `source_budget`)."""
    # the objective (torch) here, in the job: the Dagster process imports this module to read preflight records
    from ghostvis_core.run.train.objectives import build_objective

    where = {"pid": os.getpid(), "host": socket.gethostname()}
    try:
        objective = build_objective(with_local_shards(spec, store), spec.config)
        check_stream_splits(Ledger.in_store(store), spec.tokenizer_id, objective)
        spec.inputs.source_budget = preflight(spec.config, spec.plan.steps, objective)
    except GhostvisError as exc:
        store.write_json("run_file", spec.stage, spec.run_key, PREFLIGHT_FILE, data={**where, "refused": str(exc)})
        raise
    store.write_text("run_spec", spec.stage, spec.run_key, text=spec.to_json())
    store.write_json(
        "run_file",
        spec.stage,
        spec.run_key,
        PREFLIGHT_FILE,
        data={**where, "source_budget": {s: asdict(b) for s, b in spec.inputs.source_budget.items()}},
    )
    return spec


def preflight_record(store: Store, spec: LaunchSpec) -> dict | None:
    """What the run's pre-flight left (None before it ran)."""
    if not store.exists("run_file", spec.stage, spec.run_key, PREFLIGHT_FILE):
        return None
    return store.read_json("run_file", spec.stage, spec.run_key, PREFLIGHT_FILE)

"""`ghostvis data`: the backfill of every registered shard, in one Dagster run per asset (download,
tokenizer, tokenization, ledger), recorded in DAGSTER_HOME like a backfill started from the UI."""

from __future__ import annotations

import time

from ghostvis_core.home import Home
from ghostvis_core.plan import presets


def cmd_data(args) -> int:
    from dagster import DagsterInstance

    from ghostvis_pipeline.demo import format_summary, materialize_data
    from ghostvis_pipeline.environment import prepare_environment

    prepare_environment(Home.from_env())
    t0 = time.time()
    runs = materialize_data(DagsterInstance.get(), args.preset or presets.default_preset())
    print(format_summary(runs, time.time() - t0))
    return 0 if all(passed for r in runs for *_, passed in r.checks) else 1


def add_parser(sub) -> None:
    d = sub.add_parser("data", help="backfill every registered shard: download, tokenizer, tokenization, ledger")
    d.add_argument(
        "--preset", help="the preset whose tokenizer vocabulary to train (default: GHOSTVIS_PRESET, else tiny)"
    )
    d.set_defaults(fn=cmd_data)

"""What a single-run backfill costs Dagster before its run starts, on SQLite (the demo's dagster.yaml)
and on PostgreSQL (deploy/dagster-postgres.yaml, a throwaway server: tests/postgres_server.py), at N
shard partitions (issue 25: on SQLite, 13 s, 46 s and 229 s before the run starts at N = 50, 400, 2,000).

For each storage and N: a fresh instance, N `shards` partitions registered, then the run of a
raw_shards backfill over all of them created exactly as `dagster asset materialize --partition-range`
and the UI create it (`DagsterInstance.create_run_for_job` with the partition-range tags): the run
record, its snapshots and one ASSET_MATERIALIZATION_PLANNED event per partition, each its own
transaction. Timed around that call (no process start-up, no asset code). Also printed: the planned
events counted in the instance, on PostgreSQL the database's growth, and PostgreSQL with Dagster's
switch DAGSTER_EMIT_PARTITION_SUBSET_IN_PLANNED_EVENTS=true (one planned event per asset holding the
partition subset; README, "Dagster on PostgreSQL").

Goal: the team set-up (PostgreSQL and the switch) creates the backfill run of the largest N in <= 5 s.

    .venv/bin/python benchmarks/backfill_bookkeeping.py [--sizes 50,400,2000]
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common as C  # noqa: E402
from dagster import AssetKey, DagsterEventType, DagsterInstance  # noqa: E402

from ghostvis_pipeline.demo import PARTITION_RANGE_END_TAG, PARTITION_RANGE_START_TAG  # noqa: E402
from ghostvis_pipeline.environment import PROJECT_DAGSTER_YAML  # noqa: E402
from tests.postgres_server import PostgresServer, start_server  # noqa: E402

TEAM_CONFIG = C.ROOT / "deploy" / "dagster-postgres.yaml"
RAW_SHARDS = AssetKey("raw_shards")
SUBSET_SWITCH = "DAGSTER_EMIT_PARTITION_SUBSET_IN_PLANNED_EVENTS"
HEADERS = ["partitions", "sqlite s", "planned", "postgres s", "planned", "postgres +MB", "pg, one event s", "planned"]


def backfill_bookkeeping(instance: DagsterInstance, n: int, prefix: str) -> tuple[float, int]:
    """Register n partitions and create the backfill run over them: (seconds, planned events written)."""
    from ghostvis_pipeline.definitions import defs

    keys = [f"{prefix}/{i:05d}" for i in range(n)]
    instance.add_dynamic_partitions("shards", keys)
    job = defs.resolve_implicit_job_def_def_for_assets([RAW_SHARDS])
    tags = {PARTITION_RANGE_START_TAG: keys[0], PARTITION_RANGE_END_TAG: keys[-1]}
    t0 = time.perf_counter()
    run = instance.create_run_for_job(job_def=job, run_config={}, tags=tags, asset_selection=frozenset({RAW_SHARDS}))
    secs = time.perf_counter() - t0
    return secs, len(instance.all_logs(run.run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION_PLANNED))


def instance_in(folder: Path, config: Path) -> DagsterInstance:
    folder.mkdir(parents=True)
    shutil.copyfile(config, folder / "dagster.yaml")
    return DagsterInstance.from_config(str(folder))


def db_bytes(server: PostgresServer) -> int:
    out = server.client("psql", "-d", server.database, "-Atc", "SELECT pg_database_size(current_database())")
    return int(out.stdout.strip())


def on_postgres(folder: Path, n: int, server: PostgresServer, one_planned_event: bool) -> list:
    """[seconds, planned events, MB the database grew] for a backfill of n partitions on the server;
    `one_planned_event`: Dagster's switch for one planned event per asset (a partition subset) instead
    of one per partition (its cost: a failed run's partitions are not marked failed)."""
    if one_planned_event:
        os.environ[SUBSET_SWITCH] = "true"
    try:
        with instance_in(folder, TEAM_CONFIG) as instance:
            before = db_bytes(server)  # the tables exist now: only the backfill's rows are counted
            secs, planned = backfill_bookkeeping(instance, n, folder.name)
            return [secs, planned, (db_bytes(server) - before) / 1e6]
    finally:
        os.environ.pop(SUBSET_SWITCH, None)


def measure(sizes: list[int], work: Path, server: PostgresServer) -> list[list]:
    rows = []
    for n in sizes:
        with instance_in(work / f"sqlite-{n}", PROJECT_DAGSTER_YAML) as instance:
            row = [n, *backfill_bookkeeping(instance, n, f"sqlite-{n}")]
        row += on_postgres(work / f"postgres-{n}", n, server, one_planned_event=False)
        row += on_postgres(work / f"subset-{n}", n, server, one_planned_event=True)[:2]
        rows.append(row)
        print(C.table([row], HEADERS), flush=True)
    return rows


def main() -> int:
    ap = C.arguments(__doc__)
    ap.add_argument("--sizes", default="50,400,2000", help="partition counts (default 50,400,2000)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    print(C.load_snapshot("before"))
    server = start_server()
    os.environ.update(server.dagster_env())
    try:
        with C.work_folder("pg") as work, C.CpuMeter() as meter:
            rows = measure(sizes, work, server)
    finally:
        server.stop()
    print(C.table(rows, HEADERS))
    print(f"other cores: {meter.other_cores:.2f} ({C.noise_note(meter.other_cores)})")
    last = rows[-1]
    print(f"postgres/sqlite at N={last[0]}: {last[3] / last[1]:.2f} (one planned event per partition on both)")
    print(C.goal(f"postgres with one planned event, N={last[0]}", last[6], 5.0, higher_is_better=False, unit=" s"))
    print(
        C.kv_line(
            {
                f"{kind}_s_{r[0]}": r[i]
                for r in rows
                for kind, i in (("sqlite", 1), ("postgres", 3), ("postgres_one_event", 6))
            }
        )
    )
    return 0


if __name__ == "__main__":
    C.main_wrapper(main)

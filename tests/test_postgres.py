"""Dagster on PostgreSQL (deploy/dagster-postgres.yaml), the way the README's "Dagster on PostgreSQL"
section says, against a real server of the test's own (tests/postgres_server.py): `ghostvis init
--dagster-config`, shard_manifest, a single-run backfill of raw_shards over every demo shard through
`dagster asset materialize --partition-range`, the rest of the data (`ghostvis data`) and a short
pretraining stage (`ghostvis train`). The runs, the per-partition materializations and the stage's
check results must be rows in PostgreSQL, and DAGSTER_HOME must hold no SQLite database.

The demo home's store is reused (a copy), so the data assets find their shards, tokenizer and token
shards already there and the backfill's cost is mostly Dagster's bookkeeping, which is what is measured:
from launching the backfill to its RUN_START, with the one ASSET_MATERIALIZATION_PLANNED event per
partition Dagster writes before the run starts (printed; `pytest -s` shows it). `ghostvis data` runs
with the README's switch for one planned event per asset, which must still record every shard."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import psycopg2
import pytest
from dagster import DagsterEventType

from ghostvis_core.errors import GhostvisError
from ghostvis_core.home import Home
from ghostvis_core.verify.audit.stage_checks import stage_check_names
from ghostvis_core.verify.replay.check import NAME as REPLAY_CHECK
from ghostvis_pipeline.environment import env_vars_read, init_report, prepare_environment
from tests.conftest import copy_home, run_cli
from tests.postgres_server import PostgresServer, postgres_server  # noqa: F401 (a fixture)

ROOT = Path(__file__).resolve().parent.parent
TEAM_CONFIG = ROOT / "deploy" / "dagster-postgres.yaml"
PG_VARS = ["DAGSTER_PG_HOST", "DAGSTER_PG_PORT", "DAGSTER_PG_USER", "DAGSTER_PG_PASSWORD", "DAGSTER_PG_DB"]
MODULE = ["-m", "ghostvis_pipeline.definitions"]
PRETRAIN_STEPS = 4
GPU_SLOTS = 2
SQLITE_MAGIC = b"SQLite format 3\x00"
ONE_PLANNED_EVENT = "DAGSTER_EMIT_PARTITION_SUBSET_IN_PLANNED_EVENTS"


def home_env(tmp_path: Path, monkeypatch) -> Home:
    """A fresh home and instance folder; the variables prepare_environment sets are undone after the test."""
    monkeypatch.setenv("GHOSTVIS_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    return Home(tmp_path / "home")


def test_init_installs_the_team_config_and_names_its_variables(tmp_path, monkeypatch):
    home = home_env(tmp_path, monkeypatch)
    prepared = prepare_environment(home, TEAM_CONFIG)
    assert prepared.dagster_yaml == "copied"
    assert (tmp_path / "dagster" / "dagster.yaml").read_bytes() == TEAM_CONFIG.read_bytes()
    assert env_vars_read(TEAM_CONFIG) == PG_VARS
    assert (
        "  export " + " ".join(f"{v}=..." for v in PG_VARS) + "   # read by dagster.yaml"
        in init_report(prepared).splitlines()
    )
    assert prepare_environment(home, TEAM_CONFIG).dagster_yaml == "kept"  # same file: idempotent


def test_init_refuses_to_hide_another_instance_config(tmp_path, monkeypatch):
    home = home_env(tmp_path, monkeypatch)
    assert prepare_environment(home).dagster_yaml == "copied"  # the SQLite default
    with pytest.raises(
        GhostvisError, match=r"dagster\.yaml exists and differs from .*dagster-postgres\.yaml; move it away"
    ):
        prepare_environment(home, TEAM_CONFIG)
    with pytest.raises(GhostvisError, match="Dagster instance config nope.yaml not found"):
        prepare_environment(home, Path("nope.yaml"))


# ---------------------------------------------------------------- end to end, on a real server


@dataclass
class TeamRuns:
    home: Path
    server: PostgresServer
    partitions: list[str]
    backfill_run: str
    launched: float  # time.time() just before the backfill's CLI started


def sql(server: PostgresServer, query: str, *params) -> list[tuple]:
    with psycopg2.connect(server.url()) as conn, conn.cursor() as cur:
        cur.execute(query, params)
        return cur.fetchall()


def runs_of(server: PostgresServer, asset: str) -> list[str]:
    """Run ids, oldest first, in which `asset` was materialized (Dagster's event log in PostgreSQL)."""
    rows = sql(
        server,
        "SELECT run_id, min(id) FROM event_logs WHERE dagster_event_type = 'ASSET_MATERIALIZATION' "
        "AND asset_key = %s GROUP BY run_id ORDER BY 2",
        json.dumps([asset]),
    )
    return [run_id for run_id, _ in rows]


@pytest.fixture(scope="module")
def team_runs(demo_home, postgres_server, module_tmp) -> TeamRuns:
    """A copy of the demo home whose Dagster instance is replaced by the team config on the server,
    after: shard_manifest, the raw_shards backfill of every shard, `ghostvis data`, a short pretrain."""
    home = copy_home(demo_home, module_tmp("postgres") / "home")
    shutil.rmtree(home / "dagster")  # the demo's SQLite instance
    env = postgres_server.dagster_env()
    run_cli(["ghostvis", "init", "--dagster-config", str(TEAM_CONFIG)], home, **env)
    run_cli(["dagster", "instance", "concurrency", "set", "gpu", str(GPU_SLOTS)], home, **env)
    run_cli(["dagster", "asset", "materialize", "--select", "shard_manifest", *MODULE], home, **env)
    partitions = [
        p
        for (p,) in sql(
            postgres_server, "SELECT partition FROM dynamic_partitions WHERE partitions_def_name = 'shards' ORDER BY id"
        )
    ]
    launched = time.time()
    run_cli(
        [
            "dagster",
            "asset",
            "materialize",
            "--select",
            "raw_shards",
            "--partition-range",
            f"{partitions[0]}...{partitions[-1]}",
            *MODULE,
        ],
        home,
        **env,
    )
    [backfill_run] = runs_of(postgres_server, "raw_shards")
    run_cli(["ghostvis", "data"], home, **env, **{ONE_PLANNED_EVENT: "true"})  # the README's switch, here
    run_cli(["ghostvis", "train", "pretrain", "--set", f"budget.steps={PRETRAIN_STEPS}"], home, timeout=900, **env)
    return TeamRuns(home, postgres_server, partitions, backfill_run, launched)


@pytest.mark.e2e
def test_runs_and_partition_materializations_are_in_postgres(team_runs):
    t = team_runs
    assert len(t.partitions) >= 10 and len(set(t.partitions)) == len(t.partitions)
    runs = sql(t.server, "SELECT status, count(*) FROM runs GROUP BY status")
    # shard_manifest, the backfill, `ghostvis data` (raw_shards, tokenizer, tokenized_shards, token_ledger), pretrain
    assert runs == [("SUCCESS", 7)]
    materialized = sql(
        t.server,
        "SELECT partition FROM event_logs WHERE run_id = %s AND "
        "dagster_event_type = 'ASSET_MATERIALIZATION' ORDER BY id",
        t.backfill_run,
    )
    assert sorted(p for (p,) in materialized) == sorted(t.partitions)
    for asset in ("raw_shards", "tokenized_shards"):  # the backfill and `ghostvis data`'s runs cover every shard
        covered = sql(
            t.server,
            "SELECT count(DISTINCT partition) FROM event_logs WHERE asset_key = %s AND "
            "dagster_event_type = 'ASSET_MATERIALIZATION'",
            json.dumps([asset]),
        )
        assert covered == [(len(t.partitions),)]


@pytest.mark.e2e
def test_one_planned_event_switch_still_records_every_partition(team_runs):
    """`ghostvis data` ran with the README's switch: its tokenized_shards backfill planned one event for
    all the shards, and each shard still has its own materialization and its figures' observation."""
    [run] = runs_of(team_runs.server, "tokenized_shards")
    kinds = sql(
        team_runs.server,
        "SELECT dagster_event_type, count(*), count(DISTINCT partition) FROM event_logs "
        "WHERE run_id = %s AND asset_key = %s GROUP BY 1 ORDER BY 1",
        run,
        json.dumps(["tokenized_shards"]),
    )
    n = len(team_runs.partitions)
    assert kinds == [
        ("ASSET_MATERIALIZATION", n, n),
        ("ASSET_MATERIALIZATION_PLANNED", 1, 0),
        ("ASSET_OBSERVATION", n, n),
    ]


@pytest.mark.e2e
def test_stage_checks_passed_in_postgres(team_runs):
    [pretrain_run] = runs_of(team_runs.server, "pretrain")
    checks = sql(
        team_runs.server,
        "SELECT check_name, execution_status FROM asset_check_executions WHERE run_id = %s AND asset_key = %s",
        pretrain_run,
        json.dumps(["pretrain"]),
    )
    assert sorted(checks) == sorted((name, "SUCCEEDED") for name in [*stage_check_names(), REPLAY_CHECK])
    md = sql(
        team_runs.server,
        "SELECT event FROM event_logs WHERE run_id = %s AND dagster_event_type = 'ASSET_MATERIALIZATION'",
        pretrain_run,
    )
    assert len(md) == 1 and '"cached_from"' not in md[0][0]  # trained, on the data of this instance's runs


@pytest.mark.e2e
def test_gpu_pool_limit_is_shared_in_postgres(team_runs):
    """The limit set once with the CLI is a row every user's instance reads; no slot is held after the runs."""
    assert sql(team_runs.server, 'SELECT concurrency_key, "limit" FROM concurrency_limits') == [("gpu", GPU_SLOTS)]
    assert sql(
        team_runs.server,
        "SELECT count(*), count(run_id) FROM concurrency_slots WHERE concurrency_key = 'gpu' AND NOT deleted",
    ) == [(GPU_SLOTS, 0)]


@pytest.mark.e2e
def test_dagster_home_holds_no_sqlite_database(team_runs):
    dagster_home = team_runs.home / "dagster"
    assert (dagster_home / "dagster.yaml").read_bytes() == TEAM_CONFIG.read_bytes()
    sqlite = [p for p in dagster_home.rglob("*") if p.is_file() and p.open("rb").read(16) == SQLITE_MAGIC]
    assert sqlite == [] and sorted(p.name for p in dagster_home.iterdir()) == [
        "dagster.yaml",
        "storage",
    ]  # + compute logs


@pytest.mark.e2e
def test_backfill_bookkeeping_before_the_run_starts(team_runs):
    """Dagster writes one planned event per partition, each its own transaction, before RUN_START
    (on SQLite too); the time from launch to RUN_START and the database's size are printed."""
    t = team_runs
    events = sql(
        t.server,
        "SELECT dagster_event_type, extract(epoch FROM timestamp) FROM event_logs WHERE run_id = %s ORDER BY id",
        t.backfill_run,
    )
    planned = [float(ts) for kind, ts in events if kind == DagsterEventType.ASSET_MATERIALIZATION_PLANNED.value]
    [run_start] = [float(ts) for kind, ts in events if kind == DagsterEventType.RUN_START.value]  # "PIPELINE_START"
    assert len(planned) == len(t.partitions) and max(planned) <= run_start
    size = sql(t.server, "SELECT pg_database_size(current_database())")[0][0]
    events_total = sql(t.server, "SELECT count(*), sum(length(event)) FROM event_logs")[0]
    print(
        f"\nbackfill of {len(t.partitions)} partitions on PostgreSQL: launch -> RUN_START "
        f"{run_start - t.launched:.1f} s; {len(planned)} planned events over {max(planned) - min(planned):.2f} s; "
        f"database {size / 1e6:.1f} MB after every run, {events_total[0]} events, "
        f"{events_total[1] / 1e6:.2f} MB of event JSON"
    )

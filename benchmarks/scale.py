"""The data assets' bookkeeping against the number of shards (issue 25): it must grow linearly.

For each N (default 100 and 1,000; `--sizes 100,1000,10000` adds 10,000): N small own-data Parquet
shards (a `text` column, DOCS documents each) served over HTTP from a local folder, declared as the
README's "Your own data" `url_pattern` source (one shard pinned as validation), in a fresh
GHOSTVIS_HOME. Then, through the real CLIs as the README runs them: `ghostvis init`, `dagster asset
materialize` of shard_manifest (`-c sources.yaml`), raw_shards over every partition in one run
(`--partition-range`, the backfill), tokenizer, tokenized_shards (`--partition-range`) and
token_ledger, then `ghostvis status`. Each command is timed: wall, and CPU seconds of it and its
children (datatrove workers); Dagster's storage is measured after the data assets: DAGSTER_HOME's files
(SQLite, the project's dagster.yaml), or with `--postgres` the growth of a database of its own per N in a
throwaway PostgreSQL server (deploy/dagster-postgres.yaml, the team setup; tests/postgres_server.py).

Dagster runs with the team setting of README "Dagster on PostgreSQL": DAGSTER_EMIT_PARTITION_SUBSET_IN_PLANNED_EVENTS
=true, one planned event per asset and run instead of one per partition (`--planned-per-partition`
measures Dagster's default).

Printed: per N the table of steps, Dagster's storage in bytes and per shard, the events the event log holds
(each once: SQLite stores an asset's events again in its index.db, counted in the bytes), per shard and
by type, and the largest one; then per step the growth ratio CPU(big N) / CPU(small N), scaled to a tenfold N
(goal <= 12: linear in N; a quadratic term shows as ~100), and the same for the storage. CPU seconds,
not wall, since on a shared machine other processes stretch the wall time; every command includes the
CLI's start-up (a few seconds), which flatters the ratios. The goal reads the worst ratio. Then the
ledger-part side: `ledger_scale(parts)` of benchmarks/ledger_scale.py at 100 and 1,000 parts in a
demo home with a pretrain run (`--ledger-home`, else one is built; `--no-ledger` skips it).

    .venv/bin/python benchmarks/scale.py [--sizes 100,1000] [--docs 8] [--keep DIR] [--ledger-home PATH]
                                         [--planned-per-partition] [--postgres]
"""

from __future__ import annotations

import functools
import json
import random
import sqlite3
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common as C  # noqa: E402

from tests.postgres_server import PostgresServer, start_server  # noqa: E402

GOAL_TENFOLD = 12.0  # time(10 N) / time(N)
DOCS = 8  # documents per shard
WORDS = (
    "shard ledger token partition event backfill manifest stage checkpoint run model data train "
    "validation source parquet tokenizer number metadata record growth linear table count"
).split()
DAGSTER = str(Path(C.PY).parent / "dagster")
MODULE = ["-m", "ghostvis_pipeline.definitions"]
STEPS = ("init", "shard_manifest", "raw_shards", "tokenizer", "tokenized_shards", "token_ledger", "status")
PLANNED_SUBSET = "DAGSTER_EMIT_PARTITION_SUBSET_IN_PLANNED_EVENTS"  # the team setting (README "Dagster on PostgreSQL")
TEAM_CONFIG = C.ROOT / "deploy" / "dagster-postgres.yaml"
EVENTS_BY_TYPE = (
    "select coalesce(dagster_event_type, 'log line'), count(*), coalesce(max(length(event)), 0) "
    "from event_logs group by 1"
)


def write_shards(folder: Path, n: int, docs: int) -> None:
    """n FineWeb-schema shards web/00000.parquet ... of `docs` generated paragraphs each (deterministic)."""
    rng = random.Random(25)
    (folder / "web").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        texts = [
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 80))) + f" (shard {i}, doc {d})."
            for d in range(docs)
        ]
        pq.write_table(pa.table({"text": texts}), folder / "web" / f"{i:05d}.parquet")


def serve(folder: Path) -> ThreadingHTTPServer:
    """A local HTTP server over `folder` (what tests/test_own_data.py serves the README's source from)."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(folder)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # one line per request would flood the benchmark's output
        pass


def sources_yaml(port: int, n: int) -> str:
    return json.dumps(
        {
            "ops": {
                "shard_manifest": {
                    "config": {
                        "sources": [],
                        "remote": [
                            {
                                "name": "web",
                                "url_pattern": f"http://127.0.0.1:{port}/web/{{shard:05d}}.parquet",
                                "num_shards": n,
                                "validation": [f"{n - 1:05d}"],
                            }
                        ],
                    }
                }
            }
        }
    )  # JSON is YAML


@dataclass
class SizeRun:
    n: int
    seconds: dict[str, float] = field(default_factory=dict)  # wall
    cpu: dict[str, float] = field(default_factory=dict)  # CPU seconds of the command and its children
    other_cores: float = 0.0
    dagster_bytes: int = 0
    largest_event: int = 0
    events: Counter = field(default_factory=Counter)  # by Dagster event type, each event once


def commands(n: int) -> dict[str, list[str]]:
    span = f"web/00000...web/{n - 1:05d}"
    tokenizer_cfg = json.dumps({"ops": {"tokenizer": {"config": {"vocab_size": 512}}}})
    return {
        "init": [*C.GHOSTVIS, "init"],
        "shard_manifest": [
            DAGSTER,
            "asset",
            "materialize",
            *MODULE,
            "--select",
            "shard_manifest",
            "-c",
            "sources.yaml",
        ],
        "raw_shards": [DAGSTER, "asset", "materialize", *MODULE, "--select", "raw_shards", "--partition-range", span],
        "tokenizer": [
            DAGSTER,
            "asset",
            "materialize",
            *MODULE,
            "--select",
            "tokenizer",
            "--config-json",
            tokenizer_cfg,
        ],
        "tokenized_shards": [
            DAGSTER,
            "asset",
            "materialize",
            *MODULE,
            "--select",
            "tokenized_shards",
            "--partition-range",
            span,
        ],
        "token_ledger": [DAGSTER, "asset", "materialize", *MODULE, "--select", "token_ledger"],
        "status": [*C.GHOSTVIS, "status"],
    }


def run_size(
    n: int, docs: int, wd: Path, timeout: float, planned_subset: bool, server: PostgresServer | None
) -> SizeRun:
    """Every step at N = n in a fresh home under wd/n<n>; the shards served from wd/n<n>/corpus; Dagster's
    storage in the database scale_<n> of `server` when given."""
    root = wd / f"n{n}"
    write_shards(root / "corpus", n, docs)
    httpd = serve(root / "corpus")
    home = root / "my-home"
    env = C.clean_env(home)
    env["DAGSTER_HOME"] = str(home / "dagster")
    env["OMP_NUM_THREADS"] = "1"
    env[PLANNED_SUBSET] = "true" if planned_subset else "false"
    database, baseline = f"scale_{n}", 0
    if server:
        server.client("createdb", database)
        env |= server.dagster_env() | {"DAGSTER_PG_DB": database}
        baseline = pg_bytes(server, database)
    cfg = root / "sources.yaml"  # passed to -c by its absolute path (the CLIs run in the project root)
    cfg.write_text(sources_yaml(httpd.server_address[1], n))
    out = SizeRun(n)
    try:
        for step, cmd in commands(n).items():
            cmd = [str(cfg) if c == "sources.yaml" else c for c in cmd]
            if server and step == "init":
                cmd += ["--dagster-config", str(TEAM_CONFIG)]
            with C.CpuMeter() as meter:
                p = C.run_lines(cmd, env, root / f"{step}.log", timeout=timeout)
            out.seconds[step], out.cpu[step] = p.wall, meter.own_cores * meter.wall
            out.other_cores = max(out.other_cores, p.other_cores)
            print(f"  N={n:>6,} {step:<17} {p.wall:8.1f} s wall, {out.cpu[step]:7.1f} s CPU", flush=True)
            if step == "token_ledger" and server:
                out.dagster_bytes = pg_bytes(server, database) - baseline
                out.events, out.largest_event = pg_event_log_figures(server, database)
            elif step == "token_ledger":
                out.dagster_bytes = folder_bytes(home / "dagster")
                out.events, out.largest_event = event_log_figures(home / "dagster")
    finally:
        httpd.shutdown()
    return out


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def pg_bytes(server: PostgresServer, database: str) -> int:
    return int(server.client("psql", "-d", database, "-Atc", "select pg_database_size(current_database())").stdout)


def pg_event_log_figures(server: PostgresServer, database: str) -> tuple[Counter, int]:
    """(events by type, bytes of the largest) in the database's event log (one table: each event once)."""
    rows = server.client("psql", "-d", database, "-AtF", "\t", "-c", EVENTS_BY_TYPE).stdout.splitlines()
    by_type = Counter({kind: int(count) for kind, count, _ in (r.split("\t") for r in rows)})
    return by_type, max((int(r.split("\t")[2]) for r in rows), default=0)


def event_log_figures(dagster_home: Path) -> tuple[Counter, int]:
    """(events by type, bytes of the largest) in the instance's SQLite event logs, one database per run (index.db
    holds the asset events again); (empty, 0) with another storage."""
    by_type, largest = Counter(), 0
    for db in (dagster_home / "history" / "runs").glob("*.db"):
        if db.name == "index.db":
            continue
        with sqlite3.connect(db) as con:
            for kind, count, most in con.execute(EVENTS_BY_TYPE):
                by_type[kind] += count
                largest = max(largest, most)
    return by_type, largest


def events_per_shard_rows(runs: list[SizeRun]) -> list[list]:
    """Per event type with at least 0.5 events per shard at some N, and in all: events per shard at each N."""
    kinds = sorted({k for r in runs for k, c in r.events.items() if c / r.n >= 0.5})
    rows = [[k, *(r.events[k] / r.n for r in runs)] for k in kinds]
    return rows + [["every event", *(sum(r.events.values()) / r.n for r in runs)]]


def ratio_rows(runs: list[SizeRun]) -> list[list]:
    """Per step and consecutive sizes: wall and CPU seconds at both sizes, and CPU(big) / CPU(small) scaled
    to a tenfold N (CPU, since other processes on a shared machine stretch the wall time); Dagster's storage MB."""
    rows = []
    for small, big in zip(runs, runs[1:]):
        scale = 10.0 / (big.n / small.n)
        for step in STEPS:
            rows.append(
                [
                    f"{step} {small.n:,}->{big.n:,}",
                    small.seconds[step],
                    big.seconds[step],
                    small.cpu[step],
                    big.cpu[step],
                    big.cpu[step] / max(small.cpu[step], 1e-9) * scale,
                ]
            )
        rows.append(
            [
                f"Dagster storage MB {small.n:,}->{big.n:,}",
                None,
                None,
                small.dagster_bytes / 1e6,
                big.dagster_bytes / 1e6,
                big.dagster_bytes / max(small.dagster_bytes, 1) * scale,
            ]
        )
    return rows


def ledger_side(home_arg: str | None, wd: Path) -> None:
    """The ledger-part side of the issue: benchmarks/ledger_scale.py's `ledger_scale` at 100 and 1,000
    parts added to a demo home with a pretrain run (given, or built here)."""
    from ledger_scale import ledger_scale

    home, how = C.home_arg_or_build(home_arg, wd / "ledger")
    print(f"ledger parts, home {how}:", flush=True)
    results = {parts: ledger_scale(parts, home, wd / "ledger") for parts in (100, 1000)}
    names = ("ledger_s", "ledger_run_s", "audit_s", "checks_s")
    print(
        C.table(
            [[parts, *(r[k] for k in names)] for parts, r in results.items()],
            ["parts", "ghostvis ledger s", "ledger --run s", "audit --stage s", "checks s"],
        )
    )
    for k in names:
        print(
            C.goal(
                f"{k[:-2]} time(1000 parts) / time(100 parts)",
                results[1000][k] / results[100][k],
                GOAL_TENFOLD,
                higher_is_better=False,
            )
        )


def main() -> int:
    ap = C.arguments(__doc__)
    ap.add_argument("--sizes", default="100,1000", help="comma-separated shard counts (default 100,1000)")
    ap.add_argument("--docs", type=int, default=DOCS, help="documents per shard")
    ap.add_argument("--timeout", type=float, default=7200.0, help="per command, seconds")
    ap.add_argument("--keep", help="work here (must not exist) and keep the homes and logs")
    ap.add_argument("--no-ledger", action="store_true", help="skip the ledger-part side (ledger_scale.py)")
    ap.add_argument(
        "--ledger-home",
        help="a demo home with a pretrain run for the ledger-part side (default: build a smoke demo home)",
    )
    ap.add_argument(
        "--postgres",
        action="store_true",
        help="Dagster's storage in a throwaway PostgreSQL server (the team setup), not SQLite files in DAGSTER_HOME",
    )
    ap.add_argument(
        "--planned-per-partition",
        action="store_true",
        help=f"Dagster's default, one planned event per partition (else {PLANNED_SUBSET}=true)",
    )
    args = ap.parse_args()
    sizes = sorted(int(s.replace("_", "")) for s in args.sizes.split(","))

    print(C.load_snapshot("before scale"), flush=True)
    planned_subset = not args.planned_per_partition
    print(
        f"{PLANNED_SUBSET}={str(planned_subset).lower()}: "
        + (
            'one planned event per asset and run, the team setting (README "Dagster on PostgreSQL")'
            if planned_subset
            else "one planned event per partition, Dagster's default"
        ),
        flush=True,
    )
    print(
        "Dagster storage: "
        + (
            "PostgreSQL (deploy/dagster-postgres.yaml), a database per N"
            if args.postgres
            else "SQLite files in DAGSTER_HOME"
        ),
        flush=True,
    )
    server = start_server() if args.postgres else None
    keep = Path(args.keep).expanduser().resolve() if args.keep else None
    try:
        with C.work_folder("scale", what=" (homes and logs)", path=keep) as wd:
            runs = [run_size(n, args.docs, wd, args.timeout, planned_subset, server) for n in sizes]
            print()
            print(
                C.table(
                    [
                        [
                            r.n,
                            *(r.seconds[s] for s in STEPS),
                            r.dagster_bytes / 1e6,
                            r.dagster_bytes / r.n / 1e3,
                            sum(r.events.values()),
                            r.largest_event / 1e3,
                        ]
                        for r in runs
                    ],
                    ["N", *STEPS, "Dagster storage MB", "KB/shard", "events", "largest event KB"],
                )
            )
            print()
            print(C.table(events_per_shard_rows(runs), ["events per shard", *(f"N={r.n:,}" for r in runs)]))
            print()
            rows = ratio_rows(runs)
            print(
                C.table(
                    rows,
                    [
                        "step",
                        "wall s small N",
                        "wall s big N",
                        "CPU s (MB) small N",
                        "CPU s (MB) big N",
                        "ratio per tenfold N",
                    ],
                )
            )
            worst = max(rows, key=lambda r: r[5]) if rows else None
            if worst:
                print(
                    C.goal(f"worst growth per tenfold N ({worst[0]})", worst[5], GOAL_TENFOLD, higher_is_better=False)
                )
            other = max(r.other_cores for r in runs)
            print(f"other load: {other:.2f} cores ({C.noise_note(other)})")
            if not args.no_ledger:
                (wd / "ledger").mkdir(exist_ok=True)
                ledger_side(args.ledger_home, wd)
            kv = {
                "sizes": "/".join(str(n) for n in sizes),
                "planned_subset": int(planned_subset),
                "postgres": int(args.postgres),
            }
            for r in runs:
                kv |= {f"{s}_cpu_s_{r.n}": r.cpu[s] for s in ("raw_shards", "tokenized_shards", "status")}
                kv |= {
                    f"dagster_kb_per_shard_{r.n}": r.dagster_bytes / r.n / 1e3,
                    f"largest_event_kb_{r.n}": r.largest_event / 1e3,
                    f"events_per_shard_{r.n}": sum(r.events.values()) / r.n,
                }
            kv |= {
                "worst_tenfold_ratio": worst[5] if worst else None,
                "goal_met": int(bool(worst) and worst[5] <= GOAL_TENFOLD),
            }
            print(C.kv_line(kv))
            return 0
    finally:
        if server:
            server.stop()


if __name__ == "__main__":
    C.main_wrapper(main)

"""How the ledger's readers grow with the number of ledger parts (issue 25).

A real run's newest ledger part (its rows in every per-part table: parts, consumption, shares,
feeds, rollouts) is taken from a demo home and written again, through `Ledger.write_part`, as N parts
of new runs (10 segments per run, each segment's part chained to the one before, new run keys and
part ids, the real contents) into a private copy of the home. Then, at each N, timed as a user runs
them (wall time of the real command, start-up included):

- `ghostvis ledger` (every run's summary: grows with the runs it lists),
- `ghostvis ledger --run <stage>` (one run),
- `ghostvis audit --stage <stage>` (the data checks and one stage's checks, from the store and MLflow),
- the stage's Dagster asset checks, executed in process as the `checks_only` job runs them (timed
  inside the child, around `execute_in_process`, so Python's start-up is not in it).

Goal: time(1000) / time(100) <= 12 for each (linear in what is read: the three last read one run,
whatever the number of parts).

    .venv/bin/python benchmarks/ledger_scale.py [--home PATH] [--sizes 100,1000] [--stage pretrain]

`ledger_scale(parts, home, workdir)` is importable (benchmarks/scale.py calls it).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the home copy the suite makes

import _common as C  # noqa: E402

from ghostvis_core.data.ledger import Ledger  # noqa: E402
from ghostvis_core.home import Home  # noqa: E402
from ghostvis_core.runs.lookup import newest_completed_run  # noqa: E402
from tests.conftest import copy_home  # noqa: E402

GOAL_RATIO = 12.0
SEGMENTS_PER_RUN = 10

# The stage's asset checks as Dagster runs them (in process, the definitions' executor), in a child
# with DAGSTER_HOME set: prints the seconds spent executing, how many checks ran and which failed.
CHECKS_CHILD = """
import json, sys, time
from dagster import AssetSelection, DagsterInstance, Definitions, define_asset_job
from ghostvis_pipeline.definitions import defs
stage = sys.argv[1]
job = define_asset_job("ledger_scale_checks", selection=AssetSelection.checks_for_assets(stage))
resolved = Definitions.merge(defs, Definitions(jobs=[job])).get_job_def("ledger_scale_checks")
with DagsterInstance.get() as instance:
    t0 = time.time()
    result = resolved.execute_in_process(instance=instance, raise_on_error=False)
    seconds = time.time() - t0
evaluations = result.get_asset_check_evaluations()
print(json.dumps({"seconds": seconds, "checks": len(evaluations),
                  "failed": sorted(e.check_name for e in evaluations if not e.passed)}))
"""


def newest_part(ledger: Ledger, run_key: str) -> dict[str, list]:
    """The run's newest part: its rows in each per-part table (records.PART_TABLES), as records, the way
    write_part takes them."""
    chain = ledger.chain(run_key)
    if not chain:
        raise C.BenchError(f"run {run_key} has no part in {ledger.root}; materialize the run's stage first")
    head = chain[-1]
    return {
        "parts": [head],
        "consumption": ledger.consumption([head]),
        "shares": ledger.shares([head]),
        "feeds": ledger.feeds([head]),
        "rollouts": ledger.rollouts([head]),
    }


def write_copies(ledger: Ledger, part: dict[str, list], n: int, stage: str) -> None:
    """N copies of the part as runs of SEGMENTS_PER_RUN segments: new run keys, part ids and chain links."""
    head = part["parts"][0]
    prev = ""
    for i in range(n):
        run_key, segment = f"{stage}-ledgerscale{i // SEGMENTS_PER_RUN:05d}", i % SEGMENTS_PER_RUN
        prev = prev if segment else ""
        part_id = f"{run_key}.s{segment:03d}.p{head.step_last:09d}"
        row = dataclasses.replace(
            head,
            part_id=part_id,
            prev_part_id=prev,
            run_key=run_key,
            segment=segment,
            parent_run_key="",
            created_at=time.time(),
        )
        consumption = [
            dataclasses.replace(c, part_id=part_id, run_key=run_key, segment=segment) for c in part["consumption"]
        ]
        own = {
            t: [dataclasses.replace(r, part_id=part_id, run_key=run_key) for r in part[t]] or None
            for t in ("shares", "feeds", "rollouts")
        }
        ledger.write_part(row, consumption, **own)
        prev = part_id


def timed(cmd: list[str], env: dict[str, str], log: Path) -> tuple[float, int]:
    """Wall seconds and exit code of a command (output to `log`)."""
    t0 = time.time()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=C.ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    return time.time() - t0, rc


def stage_checks_seconds(home: Path, stage: str, log: Path) -> tuple[float, list[str]]:
    """Seconds the stage's Dagster checks took (in a child process), and the names of those that failed."""
    env = {**C.clean_env(home), "DAGSTER_HOME": str(home / "dagster")}
    with open(log, "w") as f:
        # -P: the working folder is not put first on sys.path, so a PYTHONPATH given (another checkout's
        # code, to measure it) is what the child imports, as it is for the `ghostvis` commands
        proc = subprocess.run(
            [C.PY, "-P", "-c", CHECKS_CHILD, stage], cwd=C.ROOT, env=env, stdout=subprocess.PIPE, stderr=f, text=True
        )
    if proc.returncode != 0:
        raise C.BenchError(f"the {stage} checks did not run (exit {proc.returncode}); log {log}:\n{C.tail(log)}")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    if not got["checks"]:
        raise C.BenchError(f"no check of {stage} ran; log {log}")
    return got["seconds"], got["failed"]


def ledger_scale(parts: int, home: Path, workdir: Path, stage: str = "pretrain") -> dict[str, float]:
    """Seconds of `ghostvis ledger`, `ghostvis ledger --run <stage>`, `ghostvis audit --stage <stage>`
    and the stage's Dagster checks in a copy of `home` holding `parts` more ledger parts (copies of
    the stage's newest run's newest part). `home` is not changed; the copy is removed afterwards."""
    C.check_home(home)
    newest = newest_completed_run(Home(home).store, stage)
    if newest is None:
        raise C.BenchError(f"{home} has no completed {stage} run; build it with `ghostvis demo --preset smoke`")
    copy = copy_home(home, workdir / f"home-{parts}")
    try:
        ledger = Ledger(copy / "store" / "ledger")
        t0 = time.time()
        write_copies(ledger, newest_part(ledger, newest.run_key), parts, stage)
        out: dict[str, float] = {"write_s": time.time() - t0}
        env = C.clean_env(copy)
        for name, args in (
            ("ledger_s", ["ledger"]),
            ("ledger_run_s", ["ledger", "--run", stage]),
            ("audit_s", ["audit", "--stage", stage]),
        ):
            log = workdir / f"{name}-{parts}.log"
            out[name], rc = timed([*C.GHOSTVIS, *args], env, log)
            if rc != 0 and not (name == "audit_s" and rc == 1):  # the audit's 1 names disagreements: timed
                raise C.BenchError(
                    f"ghostvis {' '.join(args)} exited {rc} with {parts} parts added; log {log}:\n{C.tail(log)}"
                )
            if rc == 1:
                print(f"  {parts} parts: the audit found disagreements:\n{C.tail(log, 8)}", flush=True)
        out["checks_s"], failed = stage_checks_seconds(copy, stage, workdir / f"checks-{parts}.log")
        if failed:  # timed all the same
            print(f"  {parts} parts: failed check(s) of {stage}: {', '.join(failed)}", flush=True)
        return out
    finally:
        shutil.rmtree(copy, ignore_errors=True)


def main() -> int:
    ap = C.arguments(__doc__, "a demo home with a completed run of --stage (default: build a smoke demo home)")
    ap.add_argument("--sizes", default="100,1000", help="numbers of ledger parts added (default 100,1000)")
    ap.add_argument("--stage", default="pretrain")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    with C.work_folder("ledger") as wd:
        home, how = C.home_arg_or_build(args.home, wd)
        print(f"home: {how}\n{C.load_snapshot('before')}", flush=True)
        results = {}
        with C.CpuMeter() as meter:
            for n in sizes:
                results[n] = ledger_scale(n, home, wd, args.stage)
                print(f"  {n} parts: " + ", ".join(f"{k} {v:.2f}" for k, v in results[n].items()), flush=True)
        names = ("ledger_s", "ledger_run_s", "audit_s", "checks_s")
        print(
            C.table(
                [[n, *(results[n][k] for k in names), results[n]["write_s"]] for n in sizes],
                [
                    "parts",
                    "ghostvis ledger s",
                    f"ledger --run {args.stage} s",
                    f"audit --stage {args.stage} s",
                    f"{args.stage} checks s",
                    "writing parts s",
                ],
            )
        )
        print(f"other cores while measuring: {meter.other_cores:.2f} ({C.noise_note(meter.other_cores)})")
        kv = {f"{k[:-2]}_{n}": results[n][k] for n in sizes for k in names}
        small, large = sizes[0], sizes[-1]
        for k in names:
            ratio = results[large][k] / results[small][k]
            kv[f"{k[:-2]}_ratio"] = ratio
            print(C.goal(f"{k[:-2]} time({large}) / time({small})", ratio, GOAL_RATIO, higher_is_better=False))
        print(C.kv_line(kv))
        return 0


if __name__ == "__main__":
    C.main_wrapper(main)

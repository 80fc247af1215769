"""The Slurm column of the signal matrix: every stop signal a cluster or a user sends (SIGTERM, SIGUSR1, SIGINT),
sent by Slurm to the job's steps (`scancel --signal=<sig>`, what `--signal=<sig>@<grace>` does before a time limit)
while the pretraining run trains under the Slurm launcher (2 nodes x 1 rank on the real test cluster of
tests/slurm_cluster.py: munged, slurmctld and two slurmd on this host), once with synchronous and once with async
checkpoint saves. Each run is preempted three times, once per signal, three steps into each launch; the launcher
launches it again after each (no retry used up), and it runs to its end. The torchrun column runs in the suite
(tests/test_interrupts.py); this one needs six Slurm launches more than the suite has time for.

Printed per case: the steps lost (the last step the launch trained, from its shipped output, minus the step it
committed: goal <= 1, the step in flight), the seconds from the signal to the checkpoint's marker in the store, and
whether the checkpoint the ranks named is the one the store holds; per run: whether the ledger tiles the run's steps
once and the audit's verdict (`ghostvis audit --stage pretrain`). Needs slurm-wlm and munge (`make slurm`) and root.

    .venv/bin/python benchmarks/signal_matrix.py [--home PATH]
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ghostvis_core.data.ledger import Ledger  # noqa: E402
from ghostvis_core.home import Home  # noqa: E402
from tests.conftest import BIN, cli_env, copy_home, materialize_pretrain, run_cli  # noqa: E402
from tests.slurm_cluster import start_cluster  # noqa: E402
from tests.test_slurm import shipped_output, slurm_launcher, slurm_scripts  # noqa: E402

SIGNALS = ("TERM", "USR1", "INT")
STEPS_IN = 3  # steps each launch trains past the step it resumed from before it is signalled
HANG_S = 16  # runtime.hang_timeout_s: a heartbeat every 2 s, which says how far a launch trained
TIMEOUT_S = 1200  # for one run, all its launches together
GOAL_LOST_STEPS = 1
PREEMPTION = re.compile(r"preempted at step (\d+) \((SIG\w+)\): checkpoint of step (\d+) committed")
STEP = re.compile(r"\[pretrain\] step (\d+)/")


def committed(store, run_key: str | None) -> int:
    """The newest step of `run_key` whose checkpoint marker is in the store (0: none, or no run yet)."""
    if run_key is None:
        return 0
    keys = store.keys("checkpoint_marker", "pretrain", run_key)
    return max((int(k[2].removeprefix("step_")) for k in keys if k[2].startswith("step_")), default=0)


def new_run_key(store, known: set[str]) -> str | None:
    found = {key for _, key in store.keys("run_spec", "pretrain")} - known
    return sorted(found)[0] if found else None


def wait(what: str, found, proc: subprocess.Popen, log: Path, deadline: float):
    """found()'s first true value, polled while the materialization runs."""
    while time.time() < deadline:
        value = found()
        if value:
            return value
        if proc.poll() is not None:
            raise C.BenchError(f"the materialization ended ({proc.returncode}) before {what}; log {log}")
        time.sleep(0.1)
    raise C.BenchError(f"no {what} within {TIMEOUT_S} s; log {log}")


def trained_past(store, run_key: str, step: int, since: float) -> bool:
    """Rank 0 of a launch started after `since` beat at a step at least `step`."""
    beat = ("run_file", "pretrain", run_key, "heartbeats/rank0.json")
    if not store.exists(*beat):
        return False
    data = store.read_json(*beat)
    return data["time"] > since and data["step"] >= step


def preempt_three_times(cluster, store, known, proc, log) -> tuple[str, list[float]]:
    """Each of SIGNALS to the running job once its launch trained STEPS_IN steps: (run key, seconds from each
    signal to its checkpoint's marker in the store)."""
    deadline, since, took = time.time() + TIMEOUT_S, time.time(), []
    run_key = wait("the run", lambda: new_run_key(store, known), proc, log, deadline)
    for sig in SIGNALS:
        took.append(preempt_once(cluster, store, run_key, sig, since, (proc, log, deadline)))
        since = time.time()
    return run_key, took


def preempt_once(cluster, store, run_key: str, sig: str, since: float, watched: tuple) -> float:
    """SIG`sig` to the job's steps (scancel) once the launch started after `since` trained STEPS_IN steps past the
    newest checkpoint: the seconds until the next checkpoint's marker is in the store."""
    base = committed(store, run_key)
    wait(f"step {base + STEPS_IN}", lambda: trained_past(store, run_key, base + STEPS_IN, since), *watched)
    job_id = max(cluster.run("squeue", "-h", "-t", "RUNNING", "-o", "%i").stdout.split(), key=int)
    if cluster.run("scancel", f"--signal={sig}", job_id).returncode != 0:
        raise C.BenchError(f"scancel --signal={sig} {job_id} failed")
    sent = time.time()
    wait(f"the SIG{sig} checkpoint", lambda: committed(store, run_key) > base, *watched)
    return time.time() - sent


def cases(store, run_key: str, took: list[float]) -> list[list]:
    """One row per preempted launch: signal, trained, committed, steps lost, signal-to-commit s, store agrees."""
    rows = []
    for script, seconds in zip(slurm_scripts(store, run_key), took):
        text = shipped_output(store, run_key, script)
        said = PREEMPTION.search(text)
        trained = max((int(s) for s in STEP.findall(text)), default=0)
        if said is None:
            raise C.BenchError(f"launch {script}: no preemption in its shipped output")
        step, name, saved = int(said[1]), said[2], int(said[3])
        rows.append([name, trained, saved, trained - saved, seconds, saved == step])
    return rows


def one_run(cluster, demo: Path, wd: Path, async_save: bool) -> tuple[list[list], bool, int]:
    """One preempted run: (its cases, whether its ledger tiles steps 1..N once, the audit's exit code)."""
    mode = "async" if async_save else "sync"
    home = copy_home(demo, wd / f"home-{mode}")
    store = Home(home).store
    known = {key for _, key in store.keys("run_spec", "pretrain")}
    steps = 24 + async_save  # a run of its own per save mode
    argv = materialize_pretrain(**slurm_launcher())
    config = json.loads(argv[-1])
    config["ops"]["pretrain"]["config"]["overrides"] |= {
        "budget.steps": str(steps),
        "checkpoint.every_steps": "100",
        "runtime.log_every_steps": "1",
        "runtime.hang_timeout_s": str(HANG_S),
        "checkpoint.async_save": str(async_save).lower(),
    }
    log = wd / f"{mode}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(BIN / "dagster"), *argv[1:-1], json.dumps(config)],
            env=cli_env(home),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
    try:
        run_key, took = preempt_three_times(cluster, store, known, proc, log)
        if proc.wait(timeout=TIMEOUT_S) != 0:
            raise C.BenchError(f"the {mode} run failed; log {log}:\n{C.tail(log)}")
    finally:
        if proc.poll() is None:
            proc.kill()
    chain = Ledger.in_store(store).chain(run_key)
    tiles = [p.step_first for p in chain] == [1] + [p.step_last + 1 for p in chain[:-1]] and chain[
        -1
    ].step_last == steps
    audit = run_cli(["ghostvis", "audit", "--stage", "pretrain"], home, check=False).returncode
    return [[mode, *row] for row in cases(store, run_key, took)], tiles, audit


def main() -> int:
    ap = C.arguments(__doc__, "a demo home (`ghostvis demo --preset smoke --stages pretrain`); built when not given")
    args = ap.parse_args()
    with C.work_folder("signal-matrix") as wd:
        demo = Path(args.home) if args.home else wd / "demo"
        if not args.home:
            C.build_demo_home(demo, stages=("pretrain",))
        cluster = start_cluster()
        os.environ["SLURM_CONF"] = str(cluster.conf)  # the dagster CLI's Slurm clients
        try:
            rows, runs = [], []
            for async_save in (False, True):
                found, tiles, audit = one_run(cluster, demo, wd, async_save)
                rows += found
                runs.append(("async" if async_save else "sync", tiles, audit))
        finally:
            cluster.stop()
        headers = ["save", "signal", "trained", "committed", "steps lost", "signal to commit s", "store agrees"]
        print(C.table(rows, headers))
        for mode, tiles, audit in runs:
            verdict = "pass" if audit == 0 else "FAIL"
            print(f"{mode}: ledger tiles the run's steps once: {tiles}; audit exit {audit} ({verdict})")
        lost = max(row[4] for row in rows)
        print(C.goal("steps lost per preemption (max)", float(lost), GOAL_LOST_STEPS, higher_is_better=False))
        ok = lost <= GOAL_LOST_STEPS and all(row[6] for row in rows) and all(t and not a for _, t, a in runs)
        print(
            C.kv_line(
                {
                    "cases": len(rows),
                    "max_lost_steps": lost,
                    "max_signal_to_commit_s": max(row[5] for row in rows),
                    "audits_passed": sum(not a for *_, a in runs),
                    "goal_met": int(ok),
                }
            )
        )
        return 0


if __name__ == "__main__":
    C.main_wrapper(main)

"""One writer per run, end to end through the CLI (docs/invariants.md, "Fenced commits"): a launch whose every
process is paused past the lease's expiry (a frozen VM, a stop-the-world pause) wakes after another launch took
the run over, and commits nothing more; the run's ledger tiles its steps once, one model version is registered,
and the audit passes."""

from __future__ import annotations

import re
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from ghostvis_core.data.ledger import Ledger
from ghostvis_core.home import Home
from ghostvis_core.runs.lookup import run_result
from tests.conftest import BIN, cli_env, run_cli

pytestmark = pytest.mark.e2e

STAGE = "continued_pretrain"
ARGV = [
    str(BIN / "ghostvis"), "train", STAGE,
    "--set", "budget.steps=20", "--set", "checkpoint.every_steps=10", "--set", "runtime.lease_expiry_s=8",
]  # fmt: skip
ROOT = Path(__file__).resolve().parent.parent


def signal_tree(proc: subprocess.Popen, sig: signal.Signals) -> int:
    """`sig` to the launch and every process under it (the Dagster process, torchrun, its ranks)."""
    procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for p in procs:
        p.send_signal(sig)
    return len(procs)


def wait_for(what: str, ready, launch: subprocess.Popen, timeout: float = 600) -> None:
    """Until `ready()`; the launch's output when it ended first or the time ran out."""
    deadline = time.monotonic() + timeout
    while not ready():
        if launch.poll() is not None or time.monotonic() > deadline:
            launch.kill()
            raise AssertionError(f"no {what}: {launch.communicate()[0].decode()[-4000:]}")
        time.sleep(0.1)


def test_a_paused_launch_wakes_after_a_takeover_and_commits_nothing(home_copy):
    store = Home(home_copy).store
    before = set(store.keys("checkpoint_marker", STAGE))
    first = subprocess.Popen(ARGV, env=cli_env(home_copy), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    wait_for(
        "step 10's checkpoint",
        lambda: any(k[2] == "step_000000010" for k in set(store.keys("checkpoint_marker", STAGE)) - before),
        first,
    )
    paused = signal_tree(first, signal.SIGSTOP)
    generations = {k[2] for k in store.keys("lease", STAGE) if k[2].isdigit()}
    time.sleep(9)  # past the 8 s expiry
    second = subprocess.Popen(ARGV, env=cli_env(home_copy), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    wait_for("takeover", lambda: {k[2] for k in store.keys("lease", STAGE) if k[2].isdigit()} - generations, second)
    time.sleep(2)
    signal_tree(first, signal.SIGCONT)
    outs = [p.communicate(timeout=900)[0].decode() for p in (first, second)]

    assert paused >= 4, "the launch, torchrun and its two ranks were paused"
    assert second.returncode == 0, outs[1][-4000:]
    assert first.returncode != 0, outs[0][-4000:]
    assert "lease lost" in outs[0] and "taken over by Dagster run" in outs[0], outs[0][-4000:]
    assert "ASSET_CHECK_EVALUATION" not in outs[0], "the loser's checks judged the winner's records"
    took = re.search(r"took over the lease from Dagster run \w+ \(pid \d+ on \S+\), heartbeat (\d+) s ago", outs[1])
    assert took and int(took.group(1)) >= 8, outs[1][-4000:]
    assert re.search(r"resume from step 10\b", outs[1]), outs[1][-4000:]
    key = re.search(rf"^{STAGE}: run (\S+),", outs[1], re.M).group(1)
    chain = Ledger.in_store(store).chain(key)
    steps = [(p.step_first, p.step_last) for p in chain]
    assert steps[0][0] == 1 and steps[-1][1] == 20, steps
    assert all(a[1] + 1 == b[0] for a, b in zip(steps, steps[1:], strict=False)), f"steps not tiled once: {steps}"
    result = run_result(store, STAGE, key)
    assert sum(p.real_tokens for p in chain) == result.counts.real_tokens
    with sqlite3.connect(home_copy / "mlflow.db") as db:
        versions = db.execute("select version from model_versions where run_id = ?", (result.mlflow_run_id,)).fetchall()
    assert len(versions) == 1, versions
    audit = run_cli(["ghostvis", "audit", "--stage", STAGE], home_copy, check=False)
    assert audit.returncode == 0, audit.stdout[-4000:] + audit.stderr[-2000:]

"""Interrupted is not broken (issue 42): `ghostvis train pretrain` stopped with Ctrl-C (SIGINT to its whole process
group, as a terminal sends it) at seeded moments after its checkpoints, then run again: every check passes, the
audit too. A Ctrl-C ends the Dagster run Canceled, its launcher stops the job with SIGTERM, which the ranks take as
a preemption (a checkpoint of the step they are at); MLflow points that died in an interrupted segment's buffer are
logged again from the ledger when the next segment starts (`mlflow_token_history` reads every committed step)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ghostvis_core.data.ledger import Ledger
from ghostvis_core.home import Home
from ghostvis_core.run.train import checkpoint as ckpt
from ghostvis_core.run.train.runs import run_result
from tests.conftest import BIN, cli_env, run_cli

pytestmark = pytest.mark.e2e

TRAIN = ["ghostvis", "train", "pretrain", "--set", "budget.steps=24", "--set", "checkpoint.every_steps=2"]
INTERRUPTS = 4


def committed_steps(home: Path) -> set[tuple[str, int]]:
    """(run key, step) of every committed pretrain checkpoint in the home."""
    store = Home(home).store
    runs = [key for _, key in store.keys("checkpoints", "pretrain")]
    return {(key, c.step) for key in runs for c in ckpt.list_complete(store.fetch("checkpoints", "pretrain", key))}


def test_ctrl_c_at_seeded_moments_then_the_same_command_passes_every_check(home_copy, tmp_path):
    rng = random.Random(42)
    before = committed_steps(home_copy)
    moments = []
    for i in range(INTERRUPTS):
        log = tmp_path / f"launch-{i}.log"
        seen = committed_steps(home_copy)
        with log.open("w") as out:
            proc = subprocess.Popen(
                [str(BIN / TRAIN[0]), *TRAIN[1:]],
                env=cli_env(home_copy),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=Path(__file__).resolve().parent.parent,
            )
        deadline = time.time() + 300
        while not committed_steps(home_copy) - seen - before:  # this launch committed a checkpoint
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-4000:]
            time.sleep(0.05)
        moments.append(round(rng.uniform(0.0, 3.0), 2))
        time.sleep(moments[-1])
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
        assert proc.wait(timeout=300) != 0, log.read_text()[-4000:]
    done = run_cli(TRAIN, home_copy)  # exits 1 when a check failed
    assert "pretrain: run " in done.stdout, done.stdout[-3000:]
    run_key = done.stdout.split("pretrain: run ", 1)[1].split(",", 1)[0]
    store = Home(home_copy).store
    result = run_result(store, "pretrain", run_key)
    chain = Ledger.in_store(store).chain(run_key)
    assert result.segment >= INTERRUPTS and chain[-1].step_last == 24, (moments, result.segment)
    assert [p.step_first for p in chain] == [1] + [p.step_last + 1 for p in chain[:-1]]
    audit = run_cli(["ghostvis", "audit", "--stage", "pretrain"], home_copy, check=False)
    assert audit.returncode == 0, audit.stdout[-4000:]

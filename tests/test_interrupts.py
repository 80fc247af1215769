"""Interrupted is not broken. `ghostvis train pretrain` stopped with Ctrl-C (SIGINT to its whole process group, as a
terminal sends it) at seeded moments after its checkpoints, then run again: every check passes, the audit too. A
Ctrl-C reaches torchrun, which passes SIGINT on to the ranks: they take it as a preemption and commit a checkpoint
of the step they are at (asserted: the store holds the step the ranks name); the Dagster run ends Canceled and its
launcher stops torchrun (a SIGTERM, the same preemption). MLflow points that died in an interrupted segment's buffer
are logged again from the ledger when the next segment starts (`mlflow_token_history` reads every committed step).

The signal matrix sends every stop signal a cluster or a user sends (SIGTERM, SIGUSR1, SIGINT) to the stage's
torchrun, where clusters send them (not to a rank), through the local torchrun launcher, and covers both save modes:
SIGUSR1 and SIGINT with synchronous saves, SIGTERM (what Slurm and Kubernetes send) with async ones. The signal
decides how a rank learns of the preemption, the save mode how it commits; neither depends on the other, so each
signal and each mode is sent once. Each preemption loses at most the step in flight, the checkpoint the ranks name
is the one the store holds, the relaunch resumes from it, the ledger tiles the steps once and the audit passes.
The Slurm column of the matrix is tests/test_slurm.py's preemption (`scancel --signal=TERM` to the job step), which
needs slurm-wlm."""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from ghostvis_core.data.ledger import Ledger
from ghostvis_core.home import Home
from ghostvis_core.launch.cluster.torchrun_command import AGENT_MODULE
from ghostvis_core.run.train import checkpoint as ckpt
from ghostvis_core.runs.lookup import run_result
from ghostvis_core.runs.reasons import run_reason
from ghostvis_core.store.layout import is_step_dir
from tests.conftest import BIN, cli_env, copy_home, run_cli
from tests.faults import wait_for

pytestmark = pytest.mark.e2e

TRAIN = ["ghostvis", "train", "pretrain", "--set", "budget.steps=24", "--set", "checkpoint.every_steps=2"]
INTERRUPTS = 3


def committed_steps(home: Path) -> set[tuple[str, int]]:
    """(run key, step) of every committed pretrain checkpoint in the home."""
    store = Home(home).store
    runs = [key for _, key in store.keys("checkpoints", "pretrain")]
    return {(key, c.step) for key in runs for c in ckpt.list_complete(store.fetch("checkpoints", "pretrain", key))}


def run_reason_of(home: Path, run_key: str) -> str:
    """The reasons the ranks of `run_key`'s last launch left in the store."""
    return run_reason(Home(home).store, "pretrain", run_key) or ""


def committed_in_store(home: Path, run_key: str) -> int | None:
    """The newest step of `run_key` whose COMPLETE marker is in the store."""
    keys = Home(home).store.keys("checkpoint_marker", "pretrain", run_key)
    return max((int(k[2].removeprefix("step_")) for k in keys if is_step_dir(k[2])), default=None)


PREEMPTION = r"preempted at step (\d+) \((SIG\w+)\): checkpoint of step (\d+) committed"  # a rank's reason
PREEMPTED = re.compile(r"^\[pretrain\] " + PREEMPTION, re.MULTILINE)  # as rank 0 prints it


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
        run_key = next(key for key, _ in committed_steps(home_copy) - seen - before)
        # the ranks' reasons in the store (the terminal's output may end before they print): the Ctrl-C's SIGINT,
        # passed on by torchrun, was a preemption that committed the step named, the store's newest
        said = re.findall(PREEMPTION, run_reason_of(home_copy, run_key))
        assert len(said) == 2 and said[0] == said[1], said  # both ranks, at the same step
        step, name, committed = said[0]
        assert name in ("SIGINT", "SIGTERM") and step == committed, said  # SIGTERM: the launcher's, if it came first
        assert committed_in_store(home_copy, run_key) == int(committed), said
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


SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def torchruns(launch: subprocess.Popen) -> list[psutil.Process]:
    """The torchrun processes under `launch` (the stage's, which clusters signal), oldest first."""
    found = []
    for child in psutil.Process(launch.pid).children(recursive=True):
        try:
            if AGENT_MODULE in child.cmdline():
                found.append(child)
        except psutil.Error:
            continue
    return sorted(found, key=lambda p: p.create_time())


def preempt_each_launch(
    launch: subprocess.Popen, log: Path, home: Path, signals: tuple[signal.Signals, ...]
) -> list[tuple[str, int, int, int, float]]:
    """Each of `signals` to the torchrun of one launch of the run, once it trained 3 steps of its own: (signal, the
    last step that launch trained (printed), the step the ranks stopped at, the newest committed step in the
    store, seconds from the signal to the ranks' report of their commit)."""
    out: list[tuple[str, int, int, int, float]] = []
    signalled: set[int] = set()
    for n, sig in enumerate(signals):
        wait_for(f"launch {n + 1}", lambda n=n: seg_start(log.read_text(), n) is not None, launch, log)
        start = seg_start(log.read_text(), n)
        wait_for(
            f"step {start + 3} of launch {n + 1}",
            lambda n=n, start=start: last_step(log.read_text(), n) >= start + 3,
            launch,
            log,
        )
        torchrun = wait_for(
            "its torchrun", lambda: [p for p in torchruns(launch) if p.pid not in signalled], launch, log
        )[-1]
        torchrun.send_signal(sig)
        sent, _ = time.time(), signalled.add(torchrun.pid)
        said = wait_for(f"the ranks' {sig.name}", lambda n=n: PREEMPTED.findall(log.read_text())[n:], launch, log)
        took = time.time() - sent
        step, name, committed = said[0]
        run_key = RUN_KEY.findall(log.read_text())[-1]
        out.append((name, last_step(log.read_text(), n), int(step), committed_in_store(home, run_key), took))
        assert int(committed) == out[-1][3], (said, out)  # the step named is the step the store holds
    return out


RUN_KEY = re.compile(r"\[pretrain\] run (pretrain-\w+-r\d+) segment \d+: ")
SEGMENT = re.compile(r"\[pretrain\] run pretrain-\w+-r\d+ segment \d+: (?:start|resume from step (\d+));")
STEP = re.compile(r"^\[pretrain\] step (\d+)/", re.MULTILINE)


def seg_start(text: str, n: int) -> int | None:
    """The step launch n (0-based) began at, once it said so."""
    starts = SEGMENT.findall(text)
    return int(starts[n] or 0) if len(starts) > n else None


def last_step(text: str, n: int) -> int:
    """The last step printed by launch n (0 before it printed one)."""
    parts = SEGMENT.split(text)  # text, start, text, start, ...: launch n's lines follow its start
    return max((int(s) for s in STEP.findall(parts[2 * n + 2])), default=0) if len(parts) > 2 * n + 2 else 0


@pytest.mark.parametrize(
    "async_save, signals",
    [(False, SIGNALS[1:]), (True, SIGNALS[:1])],  # every signal once: SIGTERM (async), SIGUSR1 and SIGINT (sync)
    ids=["sync-SIGUSR1-SIGINT", "async-SIGTERM"],
)
def test_every_stop_signal_to_torchrun_commits_the_step_and_the_run_resumes_exactly(
    demo_home, tmp_path, async_save, signals
):
    """One run per save mode, preempted by each of its signals to its torchrun in turn: each commits the step
    the ranks were at (at most the step in flight lost), the relaunch resumes from it, the ledger tiles the run's
    steps once and the audit passes."""
    home = copy_home(demo_home, tmp_path / "home")
    steps = 16 + async_save  # a run of its own per save mode (how a checkpoint is written is no part of its key)
    args = ["train", "pretrain", "--set", f"budget.steps={steps}", "--set", "checkpoint.every_steps=100"]
    args += ["--set", "runtime.log_every_steps=1", "--set", f"checkpoint.async_save={str(async_save).lower()}"]
    log = tmp_path / "train.log"
    with log.open("w") as out:
        launch = subprocess.Popen(
            [str(BIN / "ghostvis"), *args],
            env=cli_env(home),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=Path(__file__).resolve().parent.parent,
        )
    try:
        stops = preempt_each_launch(launch, log, home, signals)
        assert launch.wait(timeout=600) == 0, log.read_text()[-6000:]
    finally:
        if launch.poll() is None:
            launch.kill()
    print(f"preemptions ({'async' if async_save else 'sync'} saves): {stops}")
    assert [name for name, *_ in stops] == [s.name for s in signals]
    for _, trained, step, committed, _ in stops:
        assert committed == step and step <= trained <= step + 1, stops  # at most the step in flight is lost
    run_key = RUN_KEY.findall(log.read_text())[-1]
    store = Home(home).store
    chain = Ledger.in_store(store).chain(run_key)
    assert [p.step_first for p in chain] == [1] + [p.step_last + 1 for p in chain[:-1]] and chain[-1].step_last == steps
    assert [p.step_last for p in chain[:-1]] == [step for _, _, step, _, _ in stops]
    assert SEGMENT.findall(log.read_text()) == ["", *(str(step) for _, _, step, _, _ in stops)]
    assert run_result(store, "pretrain", run_key).segment == len(signals)
    audit = run_cli(["ghostvis", "audit", "--stage", "pretrain"], home, check=False)
    assert audit.returncode == 0, audit.stdout[-4000:]


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


HANG_S = 20  # the frozen run's runtime.hang_timeout_s: a heartbeat every 2.5 s


def test_a_frozen_node_is_ended_by_the_launching_side_and_the_stage_retry_resumes(demo_home, tmp_path):
    """torchrun and every rank paused (SIGSTOP: a frozen VM) after step 7, the launching process left running: no
    rank can report, so the launcher's watch of the heartbeats ends the job within the hang timeout plus a beat
    and a read, naming the node and the last step; the stage's retry resumes from the checkpoint of step 5."""
    home = copy_home(demo_home, tmp_path / "home")
    args = ["train", "pretrain", "--set", "budget.steps=15", "--set", "checkpoint.every_steps=5"]
    args += ["--set", "runtime.log_every_steps=1", "--set", f"runtime.hang_timeout_s={HANG_S}"]
    log = tmp_path / "train.log"
    with log.open("w") as out:
        launch = subprocess.Popen(
            [str(BIN / "ghostvis"), *args],
            env=cli_env(home),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=Path(__file__).resolve().parent.parent,
        )
    try:
        wait_for("step 7", lambda: last_step(log.read_text(), 0) >= 7, launch, log)
        torchrun = torchruns(launch)[0]
        frozen = [torchrun, *torchrun.children(recursive=True)]
        for proc in frozen:
            proc.suspend()
        stopped = time.time()
        wait_for("the frozen job ended", lambda: not [p for p in frozen if alive(p)], launch, log)
        waited = time.time() - stopped
        print(f"the frozen job ended {waited:.1f} s after its SIGSTOP (runtime.hang_timeout_s={HANG_S})")
        assert launch.wait(timeout=600) == 0, log.read_text()[-6000:]
    finally:
        if launch.poll() is None:
            launch.kill()
    text = log.read_text()
    # the watch counts from the read that last saw a heartbeat move, which may come up to one read (timeout/8)
    # before the freeze; at most the timeout, a beat, a read and the poll after it
    assert HANG_S - HANG_S / 8 <= waited <= HANG_S + 2 * HANG_S / 8 + 5, waited
    said = re.search(
        rf"hung: no heartbeat of run (\S+) moved for \d+ s \(runtime.hang_timeout_s={HANG_S}\): node (\S+) "
        r"\(ranks 0, 1, last step reported (\d+), in ",
        text,
    )
    assert said and said[2] == socket.gethostname() and 0 < int(said[3]) <= 8, text[
        -6000:
    ]  # a beat's step: at most HANG_S / 8 old
    resumed = SEGMENT.findall(text)
    assert resumed[0] == "" and int(resumed[1]) in (5, 10), resumed  # the retry resumes from the newest checkpoint
    store = Home(home).store
    chain = Ledger.in_store(store).chain(said[1])
    assert [p.step_first for p in chain] == [1] + [p.step_last + 1 for p in chain[:-1]] and chain[-1].step_last == 15
    assert run_result(store, "pretrain", said[1]).segment == 1

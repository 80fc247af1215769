"""The fault machinery's parts in one process: the progress watchdog's reason and exit, the preemption flag set by a
real signal, the launcher's preempted/faulted distinction (end to end: tests/test_resume.py)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from ghostvis_core.plan.config import STOP_SIGNALS
from ghostvis_core.run.train.preemption import PREEMPTED_EXIT, PREEMPTION_SIGNALS, Preempted, PreemptionFlag
from ghostvis_core.run.train.watchdog import HUNG_EXIT, Watchdog
from ghostvis_core.runs.heartbeats import FrozenJobWatch
from ghostvis_core.runs.reasons import record_reason, run_reason, was_preempted
from ghostvis_core.store import FolderStore


def test_the_watchdog_ends_a_rank_that_stopped_progressing_naming_the_rank_that_stopped_beating(tmp_path):
    store = FolderStore(tmp_path / "store")
    exits: list[int] = []
    stopped = Watchdog(store, "pretrain", "pretrain-x-r1", 1, 2, timeout_s=0.8)
    stopped.progress(7)
    stopped.beat()  # rank 1's last heartbeat, then nothing (SIGSTOP)
    said: list[tuple[str, int]] = []
    waiting = Watchdog(
        store,
        "pretrain",
        "pretrain-x-r1",
        0,
        2,
        timeout_s=0.8,
        report=lambda message, idle, step: said.append((message, step)),
        exit_fn=exits.append,
    )
    waiting.start(7)
    with waiting.waiting_in("the all-reduce of step 8's token counts"):
        deadline = time.time() + 10
        while not exits and time.time() < deadline:
            time.sleep(0.05)
    waiting.stop()
    assert exits == [HUNG_EXIT]
    # rank 0 said so while it waited (the Dagster run log and MLflow's time/since_step_s), past half the timeout
    assert said and said[0][1] == 7
    assert re.fullmatch(
        r"no step finished for \d s since step 7 \(the all-reduce of step 8's token counts\)", said[0][0]
    )
    reason = run_reason(store, "pretrain", "pretrain-x-r1")
    assert reason.startswith(f"rank 0 on {waiting.host} at ")
    assert (
        f"hung: rank 0 on {waiting.host} made no progress for " in reason
        and "after step 7 (runtime.hang_timeout_s=0.8), waiting in the all-reduce of step 8's token counts; "
        f"rank stopped: rank 1 on {waiting.host} (pid {os.getpid()}, last step 7, no heartbeat for"
        in reason
    ), reason
    assert not was_preempted(store, "pretrain", "pretrain-x-r1")


def test_every_rank_still_beating_is_a_stuck_collective(tmp_path):
    store = FolderStore(tmp_path / "store")
    exits: list[int] = []
    other = Watchdog(store, "sft", "sft-y-r1", 1, 2, timeout_s=0.8, exit_fn=lambda code: None)
    other.start(3)  # alive: beats every 0.1 s, but makes no progress either
    me = Watchdog(store, "sft", "sft-y-r1", 0, 2, timeout_s=0.8, exit_fn=exits.append)
    me.start(3)
    deadline = time.time() + 10
    while not exits and time.time() < deadline:
        time.sleep(0.05)
    me.stop()
    other.stop()
    assert exits == [HUNG_EXIT] and "every rank still beats: a collective is stuck" in me.fired


def test_every_signal_torchrun_forwards_raises_the_flag_the_ranks_all_reduce(tmp_path):
    """SIGTERM, SIGINT (Ctrl-C: no KeyboardInterrupt while the loop runs), SIGUSR1 and SIGUSR2 (Slurm's
    `--signal=USR1@...`) each set the flag, and the grace period counts from the first signal."""
    sigint_before, sigterm_before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    assert [s.name for s in PREEMPTION_SIGNALS] == list(STOP_SIGNALS) == ["SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"]
    for sig in PREEMPTION_SIGNALS:
        flag = PreemptionFlag(grace_s=30.0)
        try:
            assert flag.raised == 0 and flag.grace_left() == 30.0
            os.kill(os.getpid(), sig)
            time.sleep(0.2)  # the handler runs in the main thread at the next bytecode
            assert flag.raised == 1 and flag.signal_name == sig.name
            left = flag.grace_left()
            os.kill(os.getpid(), signal.SIGTERM)  # torchrun's own SIGTERM after the scheduler's signal
            time.sleep(0.05)
            assert flag.signal_name == sig.name and 29.0 < flag.grace_left() < left < 30.0
        finally:
            flag.restore()
    assert signal.getsignal(signal.SIGTERM) is sigterm_before and signal.getsignal(signal.SIGINT) is sigint_before


def test_a_run_is_preempted_only_when_every_failing_rank_says_so(tmp_path):
    store = FolderStore(tmp_path / "store")
    for rank in (0, 1):
        record_reason(store, "pretrain", "p-r1", rank, str(Preempted(9, "SIGTERM", 9)))
    assert was_preempted(store, "pretrain", "p-r1") and PREEMPTED_EXIT == 75
    assert "preempted at step 9 (SIGTERM): checkpoint of step 9 committed" in run_reason(store, "pretrain", "p-r1")
    record_reason(store, "pretrain", "p-r2", 0, str(Preempted(9, "SIGTERM", 9)))
    record_reason(store, "pretrain", "p-r2", 1, "RuntimeError: Connection closed by peer")
    assert not was_preempted(store, "pretrain", "p-r2")
    assert not was_preempted(store, "pretrain", "p-r3")  # no reason at all: a fault


def test_a_preemption_names_the_step_committed_or_that_none_is():
    assert str(Preempted(12, "SIGUSR1", 10)).startswith(
        "preempted at step 12 (SIGUSR1): checkpoint of step 10 committed; "
    )
    assert "no checkpoint committed yet" in str(Preempted(3, "SIGTERM", None))


def test_a_slow_phase_within_its_budget_is_no_hang_and_one_past_it_is_named(tmp_path):
    """An evaluation longer than the time left of a step's budget is slow, not hung: a phase has its own budget of
    the timeout from its start; a phase past that budget is named in the reason."""
    store = FolderStore(tmp_path / "store")
    exits: list[int] = []
    dog = Watchdog(store, "pretrain", "pretrain-p-r1", 0, 1, timeout_s=1.0, exit_fn=exits.append)
    dog.start(4)
    time.sleep(0.7)  # most of step 5's budget gone
    with dog.in_phase("the evaluation after step 4"):
        time.sleep(0.8)  # 1.5 s without a step: past the timeout counted from step 4, within the phase's own
    time.sleep(0.5)
    assert exits == [] and dog.fired is None
    with dog.in_phase("the checkpoint save of step 4"):
        deadline = time.time() + 10
        while not exits and time.time() < deadline:
            time.sleep(0.05)
    dog.stop()
    assert exits == [HUNG_EXIT]
    assert re.search(
        rf"^hung: rank 0 on {re.escape(dog.host)} was in the checkpoint save of step 4 for 1 s, past its budget of 1 s "
        r"\(runtime.hang_timeout_s=1\), waiting in the checkpoint save of step 4; ",
        dog.fired,
    ), dog.fired


BEATING = """
import sys, time
from ghostvis_core.run.train.watchdog import Watchdog
from ghostvis_core.store import FolderStore
dog = Watchdog(FolderStore(sys.argv[1]), "pretrain", "pretrain-f-r1", int(sys.argv[2]), 2, timeout_s=1.6)
dog.start(15)
print("beating", flush=True)
time.sleep(600)
"""


def test_the_launching_side_names_a_frozen_node_and_passes_over_a_finished_one(tmp_path):
    """Two ranks whose processes beat, then both are stopped (SIGSTOP: a frozen node, where no rank can report):
    the launcher's watch says so once no heartbeat moved for the timeout, naming the node and the last step; beats
    left by an earlier launch do not arm it, and ranks that stopped watching (the run finishing) are no freeze."""
    store = FolderStore(tmp_path / "store")
    earlier = Watchdog(store, "pretrain", "pretrain-f-r1", 0, 2, timeout_s=1.6)
    earlier.progress(9)
    earlier.beat()  # an earlier launch's last heartbeat
    watch = FrozenJobWatch(store, "pretrain", "pretrain-f-r1", 2, timeout_s=1.6)
    time.sleep(2.0)
    assert watch.frozen() is None and watch.moved is None  # nothing moved during this launch: not armed
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", BEATING, str(tmp_path / "store"), str(r)], env=env, stdout=subprocess.PIPE
        )
        for r in (0, 1)
    ]
    try:
        for proc in ranks:
            assert proc.stdout.readline() == b"beating\n"
        deadline = time.time() + 30
        while watch.moved is None and time.time() < deadline:
            assert watch.frozen() is None
            time.sleep(0.1)
        for proc in ranks:
            os.kill(proc.pid, signal.SIGSTOP)
        stopped = time.time()
        reason = None
        while reason is None and time.time() < stopped + 30:
            reason = watch.frozen()
            time.sleep(0.1)
        waited = time.time() - stopped
    finally:
        for proc in ranks:
            proc.kill()
            proc.wait()
    assert 1.6 <= waited <= 1.6 + 2.0, waited  # the timeout, plus up to a beat's interval and a read's
    assert re.fullmatch(
        r"hung: no heartbeat of run pretrain-f-r1 moved for \d s \(runtime.hang_timeout_s=1.6\): "
        rf"node {re.escape(earlier.host)} \(ranks 0, 1, last step reported 15, in between steps\) froze with "
        r"torchrun and every rank stopped \(a paused VM, a stalled kernel\), where no rank can report; the launcher "
        r"ended the job; the stage's retry resumes from the newest checkpoint",
        reason,
    ), reason
    finished = FrozenJobWatch(store, "pretrain", "pretrain-f-r1", 2, timeout_s=1.6)
    for r in (0, 1):
        dog = Watchdog(store, "pretrain", "pretrain-f-r1", r, 2, timeout_s=1.6)
        dog.start(24)
        time.sleep(0.3)
        dog.stop()  # the loop ended: a last heartbeat says the rank stopped watching
    deadline = time.time() + 4
    while time.time() < deadline:
        assert finished.frozen() is None
        time.sleep(0.1)
    assert finished.moved is not None  # armed, and still no freeze

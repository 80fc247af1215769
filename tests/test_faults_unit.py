"""The fault machinery's parts in one process: the progress watchdog's reason and exit, the preemption flag set by a
real signal, the launcher's preempted/faulted distinction (end to end: tests/test_resume.py)."""

from __future__ import annotations

import os
import re
import signal
import time

from ghostvis_core.run.train.preemption import PREEMPTED_EXIT, Preempted, PreemptionFlag
from ghostvis_core.run.train.reasons import record_reason, run_reason, was_preempted
from ghostvis_core.run.train.watchdog import HUNG_EXIT, Watchdog
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


def test_sigterm_and_sigusr1_raise_the_flag_the_ranks_all_reduce(tmp_path):
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        flag = PreemptionFlag()
        try:
            assert flag.raised == 0
            os.kill(os.getpid(), sig)
            time.sleep(0.05)  # the handler runs in the main thread at the next bytecode
            assert flag.raised == 1 and flag.signal_name == sig.name
        finally:
            flag.restore()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_a_run_is_preempted_only_when_every_failing_rank_says_so(tmp_path):
    store = FolderStore(tmp_path / "store")
    for rank in (0, 1):
        record_reason(store, "pretrain", "p-r1", rank, str(Preempted(9, "SIGTERM")))
    assert was_preempted(store, "pretrain", "p-r1") and PREEMPTED_EXIT == 75
    assert "preempted at step 9 (SIGTERM): checkpoint of step 9 committed" in run_reason(store, "pretrain", "p-r1")
    record_reason(store, "pretrain", "p-r2", 0, str(Preempted(9, "SIGTERM")))
    record_reason(store, "pretrain", "p-r2", 1, "RuntimeError: Connection closed by peer")
    assert not was_preempted(store, "pretrain", "p-r2")
    assert not was_preempted(store, "pretrain", "p-r3")  # no reason at all: a fault

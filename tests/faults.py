"""Faults a cluster causes, made by the tests on real processes: finding a training rank of a launch, waiting for
what a launch prints, stopping a server for an outage. Shared by tests/test_resume.py,
tests/test_separate_hosts.py and benchmarks/fault_soak.py."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ghostvis_core.launch.cluster.torchrun_command import AGENT_MODULE
from ghostvis_core.runs.lookup import identity_of

T = TypeVar("T")


def rank_pid(launch: subprocess.Popen, rank: int, not_pids: tuple[int, ...] = ()) -> int | None:
    """The pid of training rank `rank` under `launch` (on any host: the nodes' torchruns are its descendants too),
    not one of `not_pids`: the child of torchrun (`python -m ghostvis_core.run.elastic_agent`) whose RANK is `rank`."""
    import psutil

    for child in psutil.Process(launch.pid).children(recursive=True):
        try:
            parent = child.parent()
            if (
                child.pid not in not_pids
                and child.environ().get("RANK") == str(rank)
                and parent is not None
                and AGENT_MODULE in parent.cmdline()
            ):
                return child.pid
        except psutil.Error:
            continue
    return None


def torchrun_of(rank_pid: int):
    """The torchrun (a psutil.Process) that started the rank `rank_pid`: where a cluster's stop signal goes."""
    import psutil

    return psutil.Process(rank_pid).parent()


def wait_for(what: str, predicate: Callable[[], T], launch: subprocess.Popen, log: Path, timeout: float = 600) -> T:
    """predicate()'s first true value, polled while `launch` runs; an error naming `what` and the log's tail when
    the launch ends first or `timeout` passes."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = predicate()
        if got:
            return got
        if launch.poll() is not None:
            raise AssertionError(
                f"the launch ended (exit {launch.returncode}) before {what}:\n{log.read_text()[-6000:]}"
            )
        time.sleep(0.1)
    raise AssertionError(f"no {what} within {timeout:.0f} s:\n{log.read_text()[-6000:]}")


def outage(pid: int, seconds: float) -> None:
    """The server `pid` stops answering for `seconds` (SIGSTOP: connections are accepted by the kernel and wait,
    as behind a stalled load balancer), then goes on where it stopped, its data intact."""
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)


# The soak's hang timeout: above the S3 outage (a checkpoint commit waits it out, which is no hang) and above a
# step on a loaded 2-core machine
SOAK_HANG_S = 30
OUTAGE_S = 15


def run_soak(hosts, argv: list[str], home: Path, store: str, run_key: str, logs: tuple[Path, Path]) -> float:
    """Six faults of different kinds in one materialization (`argv`: the torchrun launcher on the Dagster host and
    gv1, rank 0 on gv1) of `run_key` in `store`: a second launch of the same identity, an OUTAGE_S outage of the S3
    server, rank 1 SIGKILLed, rank 1's torchrun preempted (SIGTERM), rank 1 stopped (SIGSTOP: a hang) and rank
    0's node killed, each once the launch before it resumed training. Both launches must end 0; returns the first
    one's wall seconds."""
    prefix = store.split("/", 3)[3]  # s3://bucket/<prefix>
    first = hosts.start(argv, logs[0], home, GHOSTVIS_STORE=store)
    second = None
    text = logs[0].read_text
    started = time.time()

    def until(what: str, predicate, timeout: float = 600):
        return wait_for(what, predicate, first, logs[0], timeout)

    try:
        # this identity's lease (the demo's store holds the leases of the demo's own runs)
        until("the lease", lambda: hosts.keys(f"{prefix}/leases/pretrain/{identity_of(run_key)}/"))
        second = hosts.start(argv, logs[1], home, GHOSTVIS_STORE=store)  # 1. a second launch of the identity
        until("step 1", lambda: "step 1/12" in text())
        outage(hosts.services[0].pid, OUTAGE_S)  # 2. the S3 server stops answering while the ranks train
        marker = f"{prefix}/checkpoints/pretrain/{run_key}/step_000000004/COMPLETE"
        until("checkpoint 4", lambda: marker in hosts.keys(marker))
        seen = [until("rank 1", lambda: rank_pid(first, 1))]
        os.kill(seen[0], signal.SIGKILL)  # 3. a rank dies (on the Dagster host): a fault, retried
        for launch in (1, 2, 3):  # the n-th launch after the first says "resume from step" (rank 0's start line)
            until(f"resumed launch {launch}", lambda n=launch: text().count(": resume from step") >= n)
            seen.append(until("its rank 1", lambda: rank_pid(first, 1, not_pids=tuple(seen))))
            if launch == 1:  # 4. SIGTERM to rank 1's torchrun (where a cluster sends it), which passes it on:
                # every rank commits the step it is at; the launcher launches again
                torchrun_of(seen[-1]).send_signal(signal.SIGTERM)
                until("the preemption", lambda: "preempted at step" in text())
            elif launch == 2:  # 5. SIGSTOP: rank 0's watchdog ends the job naming rank 1; retried
                os.kill(seen[-1], signal.SIGSTOP)
                until("the hang's reason", lambda: "hung: rank 0 on gv1" in text())
                os.kill(seen[-1], signal.SIGCONT)  # torchrun's SIGTERM reaches it now, not after its grace period
            else:  # 6. rank 0's node crashes: torchrun, its worker, the node shell; retried
                assert hosts.kill_node("gv1")
        assert first.wait(timeout=900) == 0, text()[-6000:]
        wall = time.time() - started
        assert second.wait(timeout=900) == 0, logs[1].read_text()[-6000:]
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
    return wall

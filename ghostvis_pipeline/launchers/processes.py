"""The job processes a launcher starts on the Dagster host (torchrun, or a node shell such as ssh):
waited on by the Dagster step, and stopped with every process they started when the step ends early:
a failed node, or the Dagster run terminated from the UI (Dagster raises DagsterExecutionInterruptedError
in the step, which goes on up once the job is stopped). They stay in the Dagster process's process
group, so that killing that group (SIGKILL of the run worker or CLI) kills torchrun too, and its ranks
with it (they die with their parent: ghostvis_core/run/train/dist.py)."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Mapping

import psutil

STOP_GRACE_S = 30  # a process that is no torchrun of a stage (a node shell) gets this long after SIGTERM
POLL_S = 0.5


def start(cmd: list[str], env: dict[str, str], inherit: Mapping[str, str] | None = None) -> subprocess.Popen:
    """`cmd` with `inherit` (None: this process's environment) plus `env`."""
    return subprocess.Popen(cmd, env={**(os.environ if inherit is None else inherit), **env})


class Frozen(Exception):
    """The job's heartbeats stopped moving while its processes still exist (runs/heartbeats.py FrozenJobWatch)."""


def wait(nodes: dict[str, subprocess.Popen], frozen: Callable[[], str | None] = lambda: None) -> tuple[str, int] | None:
    """Wait until every process has exited; the first that fails ends the wait: (name, exit code). `frozen`
    (polled too) returns a reason once the job is frozen: raised as `Frozen`."""
    while True:
        codes = {name: proc.poll() for name, proc in nodes.items()}
        bad = [(name, code) for name, code in codes.items() if code not in (None, 0)]
        if bad:
            return bad[0]
        if all(code == 0 for code in codes.values()):
            return None
        reason = frozen()
        if reason:
            raise Frozen(reason)
        time.sleep(POLL_S)


def stop(nodes: dict[str, subprocess.Popen], grace_s: float = STOP_GRACE_S) -> None:
    """Stop the processes still running and every process they started. Each gets SIGTERM (torchrun
    then stops its ranks, which it starts in sessions of their own, out of reach of a process group
    signal); whatever of the process trees is alive after `grace_s`, or when the wait is cut short,
    gets SIGKILL."""
    running = [proc for proc in nodes.values() if proc.poll() is None]
    tree = [child for proc in running for child in _descendants(proc.pid)]
    try:
        for proc in running:
            proc.terminate()
        deadline = time.monotonic() + grace_s
        for proc in running:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        psutil.wait_procs(tree, timeout=max(0.1, deadline - time.monotonic()))
    finally:
        for proc in running:
            proc.kill()
            proc.wait()
        _kill(tree)


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _kill(procs: list[psutil.Process]) -> None:
    """SIGKILL the processes still alive (ranks run in sessions of their own, outside the group)."""
    alive = [p for p in procs if p.is_running()]
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=10)

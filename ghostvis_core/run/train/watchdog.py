"""Hangs end: a progress watchdog on every rank. A rank that finishes no optimizer step for
`runtime.hang_timeout_s` ends the job, and the failure (artifact run_error, the launcher's Failure) names the
rank, its host, the last step it finished, the collective it waits in, and which rank stopped beating.

Each rank's watchdog thread writes a heartbeat (step, phase, time) into the run's files in the store
(`run_file <stage> <run_key> heartbeats/rank<r>.json`) every timeout/8 seconds. A rank stopped by SIGSTOP,
a dead peer without a TCP reset or a frozen node writes none, so when the others' watchdogs fire they can
name it from the store: the ranks whose heartbeat is older than three beats stopped; when every rank still
beats, all are alive and waiting in the named collective (a stuck collective). The process group's own
timeout (twice this, dist.setup) is the backstop when the watchdog thread itself cannot run.

Work that is no step (the held-out evaluation, a checkpoint save, rank 0's wait for its lease's renewal) is a
phase with its own budget, counted from the phase's start (the same timeout, unless the phase brings its own: a
lease renewal waits at most what store/lease.py allows it), and its end counts as progress: a slow evaluation
followed by a step is slow, not hung, and a phase past its budget is named in the reason ("was in the evaluation
after step 40 for longer than its budget").

While a step takes longer than half the timeout, rank 0 says so on its output (the Dagster run log) and logs
`time/since_step_s` to MLflow, so a hang is visible while it is in progress.

A frozen node (torchrun and every rank stopped: a paused VM, a stalled kernel) writes no heartbeat and no rank can
report it: the launching side watches the heartbeats too (runs/heartbeats.py `FrozenJobWatch`), and when none moves
for the timeout it ends the job, naming the node and the last step; the stage's retry resumes from the newest
checkpoint."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ghostvis_core.runs.heartbeats import STOPPED, heartbeat_name
from ghostvis_core.runs.reasons import HUNG, record_reason
from ghostvis_core.store import Store

HUNG_EXIT = 70  # EX_SOFTWARE: the run cannot go on as it is; the stage's retry resumes from its checkpoint


class Watchdog:
    def __init__(
        self,
        store: Store,
        stage: str,
        run_key: str,
        rank: int,
        world_size: int,
        timeout_s: float,
        *,
        report: Callable[[str, float, int], None] | None = None,
        exit_fn: Callable[[int], None] = os._exit,
    ):
        self.store, self.stage, self.run_key = store, stage, run_key
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.report = report  # rank 0: (message, seconds since the last step, that step) while a step is slow
        self.exit_fn = exit_fn
        # (seconds without progress, the last step), called before the exit: rank 0's timeline end (setup.watchdog)
        self.on_hung: Callable[[float, int], None] | None = None
        self.host = socket.gethostname()
        self.step = 0
        self.phase = "starting"
        self.progressed = time.time()
        self.fired: str | None = None
        self.phase_started: float | None = None  # inside a `phase`: when it began
        self.phase_budget_s = timeout_s  # inside a `phase`: how long it may last
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, step: int) -> None:
        """Watch from `step` on (runtime.hang_timeout_s=0: never)."""
        self.progress(step)
        if self.timeout_s <= 0:
            return
        self._thread = threading.Thread(target=self._run, name="ghostvis-watchdog", daemon=True)
        self._thread.start()

    def progress(self, step: int) -> None:
        """A step finished (called by the loop on every rank)."""
        self.step, self.progressed, self.phase = step, time.time(), "between steps"

    @contextmanager
    def in_phase(self, name: str, budget_s: float | None = None) -> Iterator[None]:
        """Work that is no step (an evaluation, a checkpoint save, a lease renewal): its own budget from its start
        (`budget_s`, else the timeout); its end counts as progress. A phase within a phase (a lease renewal in a
        save) hands the outer one back with its budget counted again from there."""
        before = (self.phase, self.phase_started, self.phase_budget_s)
        self.phase, self.phase_started = name, time.time()
        self.progressed = self.phase_started
        self.phase_budget_s = self.timeout_s if budget_s is None else budget_s
        try:
            yield
        finally:
            now = time.time()
            self.phase, self.progressed, self.phase_budget_s = before[0], now, before[2]
            self.phase_started = None if before[1] is None else now

    @contextmanager
    def waiting_in(self, phase: str) -> Iterator[None]:
        """Name what this rank is doing (a collective, a save) for a hang's reason."""
        before, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = before

    def stop(self) -> None:
        """No more watching: a last heartbeat says so, for the launching side's `FrozenJobWatch`."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self.phase = STOPPED
            try:
                self.beat()
            except Exception:  # the store is down: the launcher's watch ends with the job
                pass

    def beat(self) -> None:
        self.store.write_json(
            "run_file",
            self.stage,
            self.run_key,
            heartbeat_name(self.rank),
            data={
                "rank": self.rank,
                "host": self.host,
                "pid": os.getpid(),
                "step": self.step,
                "phase": self.phase,
                "time": time.time(),
                "progressed": self.progressed,
            },
        )

    def stopped_ranks(self, now: float) -> list[str]:
        """Ranks whose heartbeat in the store is older than three beats (or missing): stopped or gone (a live rank
        beats every eighth of the timeout, also while it waits in a collective; it may have stopped long after
        this rank's last step)."""
        out = []
        for r in range(self.world_size):
            name = heartbeat_name(r)
            if not self.store.exists("run_file", self.stage, self.run_key, name):
                out.append(f"rank {r} (no heartbeat)")
                continue
            beat = self.store.read_json("run_file", self.stage, self.run_key, name)
            if now - beat["time"] > 3 * self.timeout_s / 8:
                out.append(
                    f"rank {r} on {beat['host']} (pid {beat['pid']}, last step {beat['step']}, "
                    f"no heartbeat for {now - beat['time']:.0f} s)"
                )
        return out

    def reason(self, now: float) -> str:
        stopped = self.stopped_ranks(now)
        who = (
            f"{'rank' if len(stopped) == 1 else 'ranks'} stopped: {'; '.join(stopped)}"
            if stopped
            else "every rank still beats: a collective is stuck"
        )
        where = (
            f"was in {self.phase} for {now - self.phase_started:.0f} s, past its budget of {self.phase_budget_s:g} s"
            if self.phase_started is not None
            else f"made no progress for {now - self.progressed:.0f} s after step {self.step}"
        )
        return (
            f"{HUNG}: rank {self.rank} on {self.host} {where} (runtime.hang_timeout_s={self.timeout_s:g}), waiting in "
            f"{self.phase}; {who}; the stage's retry resumes from the newest checkpoint"
        )

    def _run(self) -> None:
        interval = max(0.05, self.timeout_s / 8)
        warned = -1
        while not self._stop.wait(interval):
            now = time.time()
            try:
                self.beat()
            except Exception:  # the store is down for a moment: beat again next time
                pass
            idle = now - self.progressed
            if self.report is not None and idle > self.timeout_s / 2 and warned != self.step:
                warned = self.step
                self.report(f"no step finished for {idle:.0f} s since step {self.step} ({self.phase})", idle, self.step)
            if idle > (self.timeout_s if self.phase_started is None else self.phase_budget_s):
                try:
                    self.fired = self.reason(now)
                except Exception as exc:  # the store cannot say who stopped: say what this rank knows
                    self.fired = f"{HUNG}: rank {self.rank} on {self.host}: no progress after step {self.step} ({exc})"
                print(f"error: {self.fired}", file=sys.stderr, flush=True)
                try:
                    record_reason(self.store, self.stage, self.run_key, self.rank, self.fired)
                finally:
                    if self.on_hung is not None:
                        self.on_hung(idle, self.step)
                    self.exit_fn(HUNG_EXIT)
                return

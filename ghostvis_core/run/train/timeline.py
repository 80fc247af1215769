"""Timeline: what one launch of a run spent its time on, recorded by rank 0 of the training job as ledger rows
(`TimelineRow`, table `timeline`) for `ghostvis goodput` (ghostvis_core/verify/goodput.py).

Every time is a duration on this host's monotonic clock (CLOCK_BOOTTIME where there is one, which the kernel's
process start time is counted on too), after the origin: the process start. Recorded: start-up (process start to
model and data ready), checkpoint load, evaluation, checkpoint saves, the steps of each committed part (the time
between two commits but the evaluation and saves in it), the wait for the run identity's lease of a job launched by
hand (before the timeline began: `waited`), and at the end the steps computed since the last commit
(uncommitted: trained again by the next launch), the hang detection, and the end with its reason.

The rows of a part are written with the part, inside its checkpoint's ledger folder (`part_rows`), so they are
committed with it; the rows after the last commit are written at the end (`end`), straight to the store's ledger.
A launch killed outright (SIGKILL, a lost node) writes no end: its time after its last commit is what the launching
side measured around it (`recorded_launch`, whose row then says `killed`). The launching side also records its own
wait for the lease (`record_lease_wait`)."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.ledger.goodput import KILLED
from ghostvis_core.data.ledger.records import TimelineRow
from ghostvis_core.data.ledger.write import LedgerWriter
from ghostvis_core.run.train.preemption import Preempted
from ghostvis_core.runs.reasons import LEASE_LOST, PREEMPTED, rank_reasons, was_preempted
from ghostvis_core.store import Store
from ghostvis_core.store.fence import LeaseLost

COMPLETED = "completed"
FAILED = "failed"
# the phases that are not steps: their time inside a part is taken out of its steps' time
NOT_STEPS = ("eval", "save")


def end_reason(exc: BaseException) -> str:
    """The end row's reason for a loop that stopped on `exc`."""
    if isinstance(exc, Preempted):
        return PREEMPTED
    return LEASE_LOST if isinstance(exc, LeaseLost) else FAILED


def now_s() -> float:
    """This host's monotonic clock, in seconds: the one the kernel counts process start times on, where it has it."""
    return time.clock_gettime(time.CLOCK_BOOTTIME) if hasattr(time, "CLOCK_BOOTTIME") else time.monotonic()


def process_start_s() -> float:
    """When this process started, on `now_s`'s clock (the kernel's start time, so the interpreter's and torch's
    imports count as start-up); now where the kernel does not say."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[19]) / os.sysconf("SC_CLK_TCK")  # starttime: ticks since boot
    except (OSError, ValueError, IndexError):
        return now_s()


def boot_id() -> str:
    """The host's boot id: two monotonic readings are on one clock only when their boot ids are the same."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return f"{socket.gethostname()}-{os.getpid()}-{time.time_ns()}"  # compared with nothing else


@dataclass
class Timeline:
    """Rank 0's timeline of one launch (on other ranks `enabled` is False and nothing is kept)."""

    run_key: str
    stage: str
    enabled: bool = True
    side: str = "job"
    origin_s: float = field(default_factory=process_start_s)
    segment: int = 0
    rows: list[TimelineRow] = field(default_factory=list)  # since the last write
    boundary_s: float = 0.0  # when the current part's steps began (after the origin)
    step_committed: int = 0
    open_since: float | None = None  # when the evaluation or save in progress began
    host: str = field(default_factory=socket.gethostname)
    boot: str = field(default_factory=boot_id)
    launch_id: str = ""  # host, pid and origin; the launching side adds the launch's start (one step, many launches)

    def __post_init__(self) -> None:
        self.launch_id = self.launch_id or f"{self.host}-{os.getpid()}-{self.origin_s:.3f}"

    def elapsed(self) -> float:
        return now_s() - self.origin_s

    def add(self, kind: str, start_s: float, duration_s: float, first: int = 0, last: int = 0, why: str = "") -> None:
        if self.enabled:
            where = (self.run_key, self.stage, self.launch_id, self.side, self.segment, self.host, self.boot)
            span = (round(start_s, 4), round(max(0.0, duration_s), 4))
            self.rows.append(TimelineRow(*where, self.origin_s, kind, *span, first, last, why))

    @contextmanager
    def phase(self, kind: str) -> Iterator[None]:
        """Time spent in `kind` (load, eval, save, lease_wait)."""
        start = self.elapsed()
        outer = self.open_since
        if kind in NOT_STEPS and outer is None:
            self.open_since = start
        try:
            yield
        finally:
            if kind in NOT_STEPS and outer is None:
                self.open_since = None
            self.add(kind, start, self.elapsed() - start)

    def waited(self, span: tuple[float, float] | None) -> None:
        """A wait for the run identity's lease (`span`: its start and end on `now_s`'s clock, as `Lease.waited`
        holds them; None: no wait, the lease joined), recorded as `lease_wait`: waiting, not start-up."""
        if span is not None:
            self.add("lease_wait", span[0] - self.origin_s, span[1] - span[0])

    def ready(self, segment: int, step: int) -> None:
        """Model and data ready (the checkpoint loaded, if any): start-up ends here, less the checkpoint loads and
        the lease wait in it; `step` is the resumed one."""
        self.segment, self.step_committed = segment, step
        at = self.elapsed()
        apart = sum(r.duration_s for r in self.rows if r.kind in ("load", "lease_wait"))
        self.add("startup", 0.0, at - apart)
        self.boundary_s = at

    def training(self) -> None:
        """The loop's first step begins (what came before it since `ready`: the evaluation before training, MLflow)."""
        self.boundary_s = self.elapsed()

    def _steps(self, last: int, why: str) -> None:
        """The steps since the part began: the time since, less the evaluation and saves in it."""
        at = self.elapsed()
        spans = [(r.start_s, r.start_s + r.duration_s) for r in self.rows if r.kind in NOT_STEPS]
        if self.open_since is not None:
            spans.append((self.open_since, at))
        inside = sum(max(0.0, min(end, at) - max(start, self.boundary_s)) for start, end in spans)
        if last > self.step_committed:
            self.add("steps", self.boundary_s, at - self.boundary_s - inside, self.step_committed + 1, last, why)
        self.boundary_s = at

    def part_rows(self, step: int) -> list[TimelineRow]:
        """At a commit of `step` (before its save): the rows since the last commit, with the part's steps."""
        self._steps(step, "committed")
        self.step_committed = step
        rows, self.rows = self.rows, []
        return rows

    def end(self, ledger: LedgerWriter, reason: str, step: int, detection_s: float = 0.0) -> None:
        """The launch's end at `step` (completed, preempted, hung, failed, lease lost): the steps since the last
        commit (computed, not kept), the hang detection, and the end row, written to the store's ledger."""
        if not self.enabled:
            return
        self._steps(step, "uncommitted")
        if detection_s:
            # the steps row above ran to now; the detection is the tail of it
            self._move_tail_to_detection(detection_s)
        self.add("end", self.elapsed(), 0.0, step, step, reason)
        rows, self.rows = self.rows, []
        ledger.write_timeline(rows, f"end{step:09d}")

    def end_safely(self, store: Store, reason: str, step: int, detection_s: float = 0.0) -> None:
        """`end` into the store's ledger; a store that cannot take it is said, never raised over the run's own
        reason for ending (the timeline then ends at its last commit, as a killed launch's does)."""
        try:
            self.end(Ledger.in_store(store), reason, step, detection_s)
        except Exception as exc:
            print(f"[{self.stage}] timeline of run {self.run_key}: its end ({reason}) not written ({exc})", flush=True)

    def _move_tail_to_detection(self, detection_s: float) -> None:
        """A hang: the last `detection_s` seconds were the watchdog's wait for a step that never came."""
        at = self.elapsed()
        last = self.rows[-1] if self.rows and self.rows[-1].reason == "uncommitted" else None
        if last is not None:
            self.rows[-1] = replace(last, duration_s=round(max(0.0, last.duration_s - detection_s), 4))
        self.add("detection", at - detection_s, detection_s)


def record_finish(store: Store, stage: str, run_key: str, began: float) -> None:
    """The launching step's mark that its work after the run's last launch (its metadata, the model's record) ended
    here: a `finish` row of no duration, on the clock of `began` (the step's start)."""
    mark = Timeline(run_key, stage, side="launcher", origin_s=began)
    mark.launch_id += "+finish"
    mark.add("finish", mark.elapsed(), 0.0)
    Ledger.in_store(store).write_timeline(mark.rows, "finish")


def record_lease_wait(store: Store, stage: str, run_key: str, began: float, span: tuple[float, float] | None) -> None:
    """The launching step's wait for the run identity's lease (`span`, on the clock of `began`, the step's start): a
    `lease_wait` row of the launching side, which goodput counts as waiting, not as the step's start-up."""
    wait = Timeline(run_key, stage, side="launcher", origin_s=began)
    wait.launch_id += "+lease"
    wait.waited(span)
    _write_safely(store, wait, "lease_wait", "its wait for the lease")


def launch_outcome(store: Store, stage: str, run_key: str) -> str:
    """How a launch that did not complete ended, from the reasons its ranks left: preempted (every rank says so),
    failed (rank 0 said why), else killed: rank 0 ended without a word (a signal, its node lost), so its timeline
    stops at its last commit and what it did after is not known."""
    if was_preempted(store, stage, run_key):
        return PREEMPTED
    return FAILED if any(r["rank"] == 0 for r in rank_reasons(store, stage, run_key)) else KILLED


def _write_safely(store: Store, timeline: Timeline, name: str, what: str) -> None:
    """The launching side's rows into the store's ledger; a store that cannot take them is said, not raised (the
    run stands, and its goodput misses them)."""
    try:
        Ledger.in_store(store).write_timeline(timeline.rows, name)
    except Exception as exc:
        print(f"[{timeline.stage}] timeline of run {timeline.run_key}: {what} not written ({exc})", flush=True)


@contextmanager
def recorded_launch(store: Store, stage: str, run_key: str, began: float) -> Iterator[None]:
    """The launching side's row of one launch of a run's job (kind launch, side launcher), from the job's start
    to its end on the launching host's clock, after `began` (the launching step's start: what came before the launch
    is its planning and lease), with its outcome (completed, or `launch_outcome`: preempted, failed, killed): what
    covers the processes' start and teardown around rank 0's own timeline, and the waits between launches."""
    launch = Timeline(run_key, stage, side="launcher", origin_s=began)
    start = launch.elapsed()
    launch.launch_id += f"+{start:.3f}"
    outcome = FAILED
    try:
        yield
        outcome = COMPLETED
    except BaseException:
        outcome = launch_outcome(store, stage, run_key)
        raise
    finally:
        launch.add("launch", start, launch.elapsed() - start, why=outcome)
        _write_safely(store, launch, "launch", "its launch row")

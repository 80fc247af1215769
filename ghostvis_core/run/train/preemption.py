"""Preemption that saves: any stop signal a cluster or a user sends (STOP_SIGNALS: SIGTERM from Kubernetes, Slurm
or torchrun's own stop, SIGUSR1/SIGUSR2 from Slurm's `--signal=USR1@...` or a requeue script, SIGINT from Ctrl-C)
reaches torchrun, which passes it on to every rank (launch/cluster/torchrun_command.py). A rank's handler only sets a
flag; the ranks agree on it with one collective at every step boundary, so all of them stop at the same step and none
waits alone in a collective the others left. They then commit a checkpoint of that step through the
CheckpointManager (an async save in flight is finished and committed first), and the job exits with
`PREEMPTED_EXIT` and the reason `preempted` (artifact run_error) naming the step the store holds, which the
launcher resumes without using up the retries kept for faults.

The grace period (`runtime.preempt_grace_s`, from the signal to the kill) holds, in this order: the step in flight,
the checkpoint and ledger part committed, then what needs the network and may wait (MLflow's last points and the
KILLED status, the lease), each bounded by what is left of the grace period: if it runs out there, nothing
committed is lost. A save cut short by the kill never publishes a partial checkpoint: the folder is renamed into
place and its COMPLETE marker written last, so the previous checkpoint stays the newest and at most the steps
since it are trained again.
"""

from __future__ import annotations

import signal
import threading
import time

from ghostvis_core.plan.config import STOP_SIGNALS
from ghostvis_core.runs.reasons import PREEMPTED
from ghostvis_core.store.lease import Lease

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: try again later
PREEMPTION_SIGNALS = tuple(signal.Signals[name] for name in STOP_SIGNALS)


class Preempted(Exception):
    """Raised by the loop once the preemption checkpoint is committed; the entry point exits PREEMPTED_EXIT."""

    def __init__(self, step: int, signal_name: str, committed: int | None):
        saved = f"checkpoint of step {committed} committed" if committed is not None else "no checkpoint committed yet"
        super().__init__(
            f"{PREEMPTED} at step {step} ({signal_name}): {saved}; launch the "
            "stage again to resume from it (the launcher does)"
        )
        self.step, self.committed = step, committed


class PreemptionFlag:
    """This rank's signal handlers and the flag they set, and rank 0's lease: the reasons to stop that the ranks
    agree on. Installed from the main thread (Python runs signal handlers there); the handler only records, the
    loop acts at the step's end."""

    def __init__(self, grace_s: float, lease: Lease | None = None) -> None:
        self.grace_s = grace_s  # runtime.preempt_grace_s
        self.lease = lease  # rank 0's hold on the run identity (None on other ranks, and with no launch lease)
        self.signal_name: str | None = None
        self.signalled_at: float | None = None  # this rank's clock when the first stop signal came
        self._before: dict[signal.Signals, object] = {}  # the handlers before (SIGINT's raises KeyboardInterrupt)
        if threading.current_thread() is threading.main_thread():
            self._before = {sig: signal.signal(sig, self._record) for sig in PREEMPTION_SIGNALS}

    def _record(self, signum, _frame) -> None:
        if self.signal_name is None:  # a second signal (torchrun's, after the scheduler's) keeps the first's time
            self.signal_name, self.signalled_at = signal.Signals(signum).name, time.monotonic()

    def grace_left(self) -> float:
        """Seconds of the grace period left on this rank (all of it when this rank was not signalled itself)."""
        if self.signalled_at is None:
            return self.grace_s
        return max(0.0, self.grace_s - (time.monotonic() - self.signalled_at))

    @property
    def raised(self) -> int:
        """1 once this rank was signalled: a flag the ranks all-reduce at a step's end (Trainer.step_figures)."""
        return int(self.signal_name is not None)

    @property
    def lease_lost(self) -> int:
        """1 once rank 0's lease is lost (a clock read while it was renewed in time; otherwise rank 0 renews it
        first, and the other ranks wait in the step's all-reduce): the ranks then stop committing nothing."""
        return int(self.lease is not None and self.lease.hold() is not None)

    def restore(self) -> None:
        """The handlers from before again (after the loop: the final save and registration are not preemptible)."""
        for sig, handler in self._before.items():
            signal.signal(sig, handler)

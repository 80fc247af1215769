"""Preemption that saves: SIGTERM or SIGUSR1 to any rank (a Slurm job at its time limit, a spot node reclaimed,
a Kubernetes eviction's grace period, torchrun passing on its own SIGTERM) sets a flag; the ranks agree on it
with one collective at every step boundary, so all of them stop at the same step and none waits alone in a
collective the others left. They then commit a checkpoint of that step through the CheckpointManager and the
job exits with `PREEMPTED_EXIT` and the reason `preempted` (artifact run_error), which the launcher resumes
without using up the retries kept for faults.

A step in flight when the signal comes is finished first (a checkpoint is a step boundary): at most one step's
time plus a save must fit in the grace period. A save cut short by the end of the grace period (SIGKILL) never
publishes a partial checkpoint: the folder is renamed into place and its COMPLETE marker written last, so the
previous checkpoint stays the newest and at most the steps since it are trained again.
"""

from __future__ import annotations

import signal
import threading

from ghostvis_core.run.train.reasons import PREEMPTED
from ghostvis_core.store.lease import Lease

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: try again later
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# What a rank's flag says at a step boundary (all-reduced with max, so every rank learns the strongest): told to
# stop by a signal (commit, then stop), or rank 0 lost the run's lease (stop, committing nothing more).
STOP_SIGNALLED, STOP_LEASE_LOST = 1, 2


class Preempted(Exception):
    """Raised by the loop once the preemption checkpoint is committed; the entry point exits PREEMPTED_EXIT."""

    def __init__(self, step: int, signal_name: str, given_up: str = ""):
        super().__init__(
            f"{PREEMPTED} at step {step} ({signal_name}{'; ' + given_up if given_up else ''}): checkpoint of step "
            f"{step} committed; launch the stage again to resume from it (the launcher does)"
        )
        self.step = step


class PreemptionFlag:
    """This rank's signal handlers and the flag they set, and rank 0's lease: the reasons to stop that the ranks
    agree on. Installed from the main thread (Python runs signal handlers there); the handler only records, the
    loop acts at the next micro-batch or step boundary."""

    def __init__(self, lease: Lease | None = None) -> None:
        self.signal_name: str | None = None
        self.lease = lease  # rank 0's hold on the run identity (None on other ranks, and with no launch lease)
        if threading.current_thread() is threading.main_thread():
            for sig in PREEMPTION_SIGNALS:
                signal.signal(sig, self._record)

    def _record(self, signum, _frame) -> None:
        self.signal_name = signal.Signals(signum).name

    @property
    def raised(self) -> int:
        """The flag the ranks all-reduce at a boundary (Trainer.checkpoint): STOP_LEASE_LOST once this rank's lease
        is lost (a clock read while it was renewed in time; otherwise rank 0 renews it first, and the other ranks
        wait in the all-reduce), STOP_SIGNALLED once it was signalled, else 0."""
        if self.lease is not None and self.lease.hold():
            return STOP_LEASE_LOST
        return STOP_SIGNALLED if self.signal_name is not None else 0

    def restore(self) -> None:
        """Default handlers again (after the loop: the final save and registration are not preemptible)."""
        if threading.current_thread() is threading.main_thread():
            for sig in PREEMPTION_SIGNALS:
                signal.signal(sig, signal.SIG_DFL)

"""Goodput of the time a run could not train: the waits for the run identity's lease (the launching step's and a job
launched by hand, measured with two real holders of one lease in a folder store), counted as waiting and not as
start-up; and a launch killed outright, whose launching side's row says `killed` and whose time after its last commit
is its fault's cost, unrecorded (ghostvis_core/run/train/timeline.py, ghostvis_core/data/ledger/goodput.py)."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest

from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.ledger.goodput import KILLED, run_goodput
from ghostvis_core.run.train.timeline import Timeline, now_s, record_finish, record_lease_wait, recorded_launch
from ghostvis_core.runs.reasons import clear_reasons, record_reason
from ghostvis_core.store import lease
from ghostvis_core.store.folder import FolderStore
from ghostvis_pipeline.goodput_command import goodput_lines
from tests.ledger_rows import part
from tests.test_goodput_ledger import CHAIN, RUN, row, three_launches

HELD_S = 0.6  # how long the first holder keeps the lease after the second one asked for it
CLOSE_S = 0.05  # a recorded wait against the one measured around the call: the calls around it, on a loaded machine


def second_holder_waits(store: FolderStore) -> tuple[lease.Lease, float]:
    """Two holders of the run identity's lease: the first takes it, the second asks for it from its own thread (as
    a second launch would) and takes it once the first releases it HELD_S later. The second's lease, and its wait
    measured here around its call."""
    first = lease.acquire(store, "pretrain", "pretrain-g", holder={"run_key": RUN}, expiry_s=60)
    got: list[lease.Lease] = []
    measured: list[float] = []

    def take() -> None:
        start = now_s()
        got.append(lease.acquire(store, "pretrain", "pretrain-g", expiry_s=60, poll_s=0.02, log=lambda _: None))
        measured.append(now_s() - start)

    waiter = threading.Thread(target=take)
    waiter.start()
    time.sleep(HELD_S)
    first.release()
    waiter.join(timeout=30)
    assert got and got[0].number == first.number + 1 and measured[0] >= HELD_S
    return got[0], measured[0]


def test_a_job_launched_by_hand_records_its_wait_for_the_lease_as_waiting_not_start_up(tmp_path):
    store = FolderStore(tmp_path / "store")
    held, measured = second_holder_waits(store)
    ledger = Ledger.in_store(store)
    t = Timeline(RUN, "pretrain")  # its origin: this process's start, before the wait
    t.waited(held.waited)
    t.ready(segment=0, step=0)
    ready_at = t.elapsed()
    t.training()
    time.sleep(0.1)
    ledger.write_timeline(t.part_rows(4), "p000000004")
    t.end(ledger, "completed", 4)
    rows = ledger.timeline([RUN])
    (wait,) = [r for r in rows if r.kind == "lease_wait"]
    (startup,) = [r for r in rows if r.kind == "startup"]
    assert wait.duration_s == pytest.approx(measured, abs=CLOSE_S)
    assert startup.duration_s + wait.duration_s == pytest.approx(ready_at, abs=CLOSE_S)  # not in start-up too
    g = run_goodput(RUN, "pretrain", rows, [part("a", RUN, steps=(1, 4))])
    assert g.seconds["waiting"] == pytest.approx(measured, abs=CLOSE_S)
    assert g.seconds["startup"] == pytest.approx(startup.duration_s)
    assert sum(g.seconds.values()) == pytest.approx(g.wall_s) and g.productive_steps == 4


def test_the_launching_steps_wait_for_the_lease_is_waiting_before_its_first_launch(tmp_path):
    store = FolderStore(tmp_path / "store")
    began = now_s()  # the step's start: its planning, then the lease
    held, measured = second_holder_waits(store)
    record_lease_wait(store, "pretrain", RUN, began, held.waited)
    with recorded_launch(store, "pretrain", RUN, began):
        time.sleep(0.1)
    record_finish(store, "pretrain", RUN, began)
    rows = Ledger.in_store(store).timeline([RUN])
    assert [r.kind for r in rows if r.side == "launcher"] == ["lease_wait", "launch", "finish"]
    g = run_goodput(RUN, "pretrain", rows, CHAIN)
    (launch,) = [r for r in rows if r.kind == "launch"]
    assert g.seconds["waiting"] == pytest.approx(measured, abs=CLOSE_S)
    # before the launch: the wait; the rest of it, and the launch with no job rows, are start-up
    assert g.seconds["startup"] == pytest.approx(launch.start_s - measured + launch.duration_s, abs=CLOSE_S)
    assert sum(g.seconds.values()) == pytest.approx(g.wall_s)


def test_lease_waits_before_the_first_launch_and_in_a_retrys_gap_are_waiting():
    """Hand-built: the first step waits 3 s of its 10 s before its first launch; the retry after L1's fault (its
    step began at 1051) waits 2 s of the 5 s gap between L1 (ended at 1050) and L2."""
    rows = [
        *three_launches(),
        row("W1", "lease_wait", 2, 3, side="launcher", origin=990),
        row("W2", "lease_wait", 1, 2, side="launcher", origin=1051),
    ]
    base = run_goodput(RUN, "pretrain", three_launches(), CHAIN)
    g = run_goodput(RUN, "pretrain", rows, CHAIN)
    assert g.wall_s == base.wall_s == 117
    assert g.seconds["waiting"] == base.seconds["waiting"] + 3 + 2 == 7
    assert g.seconds["startup"] == base.seconds["startup"] - 3
    assert g.seconds["detection"] == base.seconds["detection"] - 2 == 3  # the back-off less the retry's wait
    assert sum(g.seconds.values()) == pytest.approx(g.wall_s)


def test_a_launch_whose_rank_0_left_no_reason_is_recorded_as_killed(tmp_path):
    """The launching side's outcome of a launch that raised, from the reasons its ranks left (cleared before each
    launch, as the launchers do): every rank preempted; rank 0 said why (failed); only rank 1 did, or none (killed)."""
    store = FolderStore(tmp_path / "store")
    began = now_s()
    left = {
        "preempted": {0: "preempted: told to stop", 1: "preempted: told to stop"},
        "failed": {0: "RuntimeError: out of memory", 1: "DistBackendError: connection closed by peer"},
        "killed by rank 1's word alone": {1: "DistBackendError: connection closed by peer"},
        "killed without a word": {},
    }
    for reasons in left.values():
        clear_reasons(store, "pretrain", RUN)
        with pytest.raises(RuntimeError), recorded_launch(store, "pretrain", RUN, began):
            for rank, reason in reasons.items():
                record_reason(store, "pretrain", RUN, rank, reason)
            raise RuntimeError("the launcher's job ended")
    rows = Ledger.in_store(store).timeline([RUN])
    assert [r.reason for r in sorted(rows, key=lambda r: r.start_s)] == ["preempted", "failed", KILLED, KILLED]


def killed_first_launch(reason: str, keep_job: bool = True) -> list:
    """three_launches with L1 ended as `reason` and J1 gone after its last commit (the save that ended at 27 s),
    or with no rows at all (`keep_job` False: killed, or refused, before it wrote any)."""
    rows = []
    for r in three_launches():
        if r.launch_id == "J1" and (not keep_job or r.kind == "end" or r.reason == "uncommitted"):
            continue
        rows.append(replace(r, reason=reason) if r.launch_id == "L1" else r)
    return rows


@pytest.mark.parametrize("outcome", [KILLED, "failed"])
def test_a_killed_launchs_time_after_its_last_commit_is_its_faults_cost_and_unrecorded(outcome):
    """Killed as the launching side recorded it, or as its job's missing end row shows (a launching side that
    could not tell): 50 s of L1 less J1's 27 s of rows are unrecorded, and the fault list names L1 killed."""
    g = run_goodput(RUN, "pretrain", killed_first_launch(outcome), CHAIN)
    assert g.seconds["unrecorded"] == 50 - 27
    assert sum(g.seconds.values()) == pytest.approx(g.wall_s) and g.wall_s == 117
    killed, preempted = g.faults
    # its 50 s less its start-up, kept steps and save (25) and evaluation (2); the 5 s back-off; L2's 7 s restart
    assert (killed.launch, killed.reason, killed.seconds, killed.steps, killed.unrecorded_s) == (1, KILLED, 35, 0, 23)
    assert (preempted.reason, preempted.unrecorded_s) == ("preempted", 0)
    assert (
        "  launch 1 (killed) cost 35.0 s and 0 steps (0 token slots); 23.0 s of it unrecorded (the steps it computed "
        "after its last commit are unknown)"
    ) in goodput_lines(g)


def test_a_launch_killed_before_it_wrote_a_row_is_unrecorded_and_one_refused_before_training_is_start_up():
    killed = run_goodput(RUN, "pretrain", killed_first_launch(KILLED, keep_job=False), CHAIN)
    refused = run_goodput(RUN, "pretrain", killed_first_launch("failed", keep_job=False), CHAIN)
    assert killed.seconds["unrecorded"] == 50 and killed.faults[0].unrecorded_s == 50
    assert refused.seconds["unrecorded"] == 0 and refused.faults[0].reason == "failed"
    assert refused.seconds["startup"] == killed.seconds["startup"] + 50
    assert killed.wall_s == refused.wall_s == 117

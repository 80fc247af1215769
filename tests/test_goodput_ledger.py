"""Goodput from the ledger (ghostvis_core/data/ledger/goodput.py) on timelines built by hand, whose every
figure is worked out below, and a real Timeline (ghostvis_core/run/train/timeline.py) written to a ledger and
read back."""

from __future__ import annotations

import time

import pytest

from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.ledger.goodput import CATEGORIES, ledger_goodput, run_goodput
from ghostvis_core.data.ledger.records import TimelineRow
from ghostvis_core.run.train.timeline import Timeline, now_s, record_finish, recorded_launch
from ghostvis_core.runs.reasons import record_reason
from ghostvis_core.store.folder import FolderStore
from tests.ledger_rows import part

RUN = "pretrain-g-r1"
T = 0.2  # seconds a phase of the real timeline below lasts: well above a loaded machine's sleep overshoot


def row(launch: str, kind: str, start: float, dur: float, *, side="job", origin=0.0, segment=0, steps=(0, 0),
        why="", boot="boot-a", created=0.0) -> TimelineRow:  # fmt: skip
    return TimelineRow(RUN, "pretrain", launch, side, segment, "h", boot, origin, kind, start, dur, *steps, why,
                       created_at=created or origin + start + dur)  # fmt: skip


def three_launches() -> list[TimelineRow]:
    """A launch killed by a fault after committing steps 1-4 (steps 5-6 computed, not kept), a preempted one
    that commits 5-8, and the one that completes 9-10; the launching side's rows around each."""
    return [
        row("L1", "launch", 10, 50, side="launcher", origin=990, why="failed"),  # 10 s of planning before it
        row("J1", "startup", 0, 5, origin=1002),
        row("J1", "eval", 5, 2, origin=1002),
        row("J1", "steps", 7, 18, origin=1002, steps=(1, 4), why="committed"),
        row("J1", "save", 25, 2, origin=1002),
        row("J1", "steps", 27, 8, origin=1002, steps=(5, 6), why="uncommitted"),
        row("J1", "end", 38, 0, origin=1002, steps=(6, 6), why="failed"),
        row("L2", "launch", 0, 30, side="launcher", origin=1055, why="preempted"),  # 5 s after L1: the back-off
        row("J2", "startup", 0, 4, origin=1056, segment=1),
        row("J2", "load", 4, 2, origin=1056, segment=1),
        row("J2", "steps", 6, 14, origin=1056, segment=1, steps=(5, 8), why="committed"),
        row("J2", "save", 20, 1, origin=1056, segment=1),
        row("J2", "end", 22, 0, origin=1056, segment=1, steps=(8, 8), why="preempted"),
        row("L3", "launch", 0, 20, side="launcher", origin=1087, why="completed"),  # 2 s after L2: the requeue
        row("J3", "startup", 0, 3, origin=1088, segment=2),
        row("J3", "load", 3, 1, origin=1088, segment=2),
        row("J3", "steps", 4, 10, origin=1088, segment=2, steps=(9, 10), why="committed"),
        row("J3", "save", 14, 1, origin=1088, segment=2),
        row("J3", "end", 16, 0, origin=1088, segment=2, steps=(10, 10), why="completed"),
    ]


CHAIN = [
    part("p4", RUN, steps=(1, 4), segment=0),
    part("p8", RUN, steps=(5, 8), segment=1, prev="p4"),
    part("p10", RUN, steps=(9, 10), segment=2, prev="p8"),
]


def test_the_categories_of_three_launches_add_up_to_the_launching_sides_wall():
    g = run_goodput(RUN, "pretrain", three_launches(), CHAIN)
    assert g.wall_s == 10 + 50 + 30 + 20 + 5 + 2
    assert g.seconds == {
        "productive": 18 + 14 + 10,
        "redone": 8,
        "startup": 10 + (5 + 4 + 3) + (50 - 38) + (30 - 22) + (20 - 16),  # planning, rank 0's, the launches'
        "checkpoint_load": 2 + 1,
        "checkpoint_save": 2 + 1 + 1,
        "evaluation": 2,
        "waiting": 2,  # after the preemption
        "detection": 5,  # after the fault
        "unrecorded": 0,
        "other": (38 - 35) + (22 - 21) + (16 - 15),  # each job's time in no row
    }
    assert sum(g.seconds.values()) == pytest.approx(g.wall_s)
    assert (g.productive_steps, g.redone_steps, g.launches) == (10, 2, 3)
    assert (g.tokens_once, g.tokens_thrown_away) == (10 * 32, 2 * 32)
    assert g.goodput == pytest.approx(42 / 117)
    assert set(g.metrics()) >= {f"goodput/{k}_s" for k in CATEGORIES}


def test_each_launch_that_did_not_complete_costs_its_time_after_its_kept_work_the_wait_and_the_next_restart():
    g = run_goodput(RUN, "pretrain", three_launches(), CHAIN)
    # L1: 50 s less its start-up, steps kept, save and evaluation (27) = 23 (8 redone, 3 other, 12 teardown); 5 s of
    # back-off; L2's restart: 1 s to rank 0's start, 4 s start-up, 2 s load
    # L2: 30 s less 21 kept = 9; 2 s to L3; L3's restart: 1 + 3 + 1
    assert [(f.launch, f.reason, f.seconds, f.steps, f.tokens) for f in g.faults] == [
        (1, "failed", 23 + 5 + 7, 2, 64),
        (2, "preempted", 9 + 2 + 5, 0, 0),
    ]
    assert g.as_dict()["faults"][0] == {
        "launch": 1,
        "reason": "failed",
        "seconds": 35,
        "steps": 2,
        "tokens": 64,
        "unrecorded_s": 0,
    }


def test_a_committed_part_off_the_chain_is_redone_and_a_launch_killed_outright_is_unrecorded():
    rows = three_launches()
    # J1's end never written (its node died): its time after its last row is the launch's, unrecorded
    rows = [r for r in rows if not (r.launch_id == "J1" and r.kind in ("end", "steps") and r.reason != "committed")]
    chain = [part("p4b", RUN, steps=(1, 4), segment=1), *CHAIN[1:]]  # steps 1-4 were passed over and retrained
    g = run_goodput(RUN, "pretrain", rows, chain)
    assert (g.productive_steps, g.redone_steps) == (6, 4)
    assert g.seconds["redone"] == 18
    assert g.seconds["unrecorded"] == 50 - 27  # L1's time after J1's last row (the save ending at 27)
    assert sum(g.seconds.values()) == pytest.approx(g.wall_s) and g.wall_s == 117


def test_launches_on_clocks_that_cannot_be_compared_add_durations_and_leave_the_gap_unmeasured():
    rows = [r for r in three_launches() if r.side == "job"]
    rows = [r if r.launch_id != "J3" else TimelineRow(**{**r.__dict__, "boot_id": "boot-b"}) for r in rows]
    g = run_goodput(RUN, "pretrain", rows, CHAIN)
    assert g.unmeasured_gaps == 1  # J2 -> J3
    assert g.seconds["detection"] == 1056 - (1002 + 38)  # J1 failed: its end to J2's process start
    assert g.wall_s == 38 + 22 + 16 + 16 and sum(g.seconds.values()) == pytest.approx(g.wall_s)


def test_a_timeline_written_to_the_ledger_reads_back_as_the_time_it_measured(tmp_path):
    """A real Timeline on this host's clock: start-up, a load, two parts' steps with an evaluation and a save in
    the first, steps not committed and a hang's detection; the rows read back from the ledger add up to its wall."""
    ledger = Ledger(tmp_path / "ledger")
    t = Timeline(RUN, "pretrain")
    with t.phase("load"):
        time.sleep(T)
    t.ready(segment=0, step=0)
    t.training()
    time.sleep(T)
    with t.phase("eval"):
        time.sleep(T)
    with t.phase("save"):  # the part's rows are taken inside the save (after the ranks' parts are gathered)
        time.sleep(T)
        ledger.write_timeline(t.part_rows(4), "p000000004")
        time.sleep(T)
    time.sleep(T)
    ledger.write_timeline(t.part_rows(8), "p000000008")
    time.sleep(2 * T)
    t.end(ledger, "hung", 10, detection_s=1.2 * T)
    rows = ledger.timeline([RUN])
    kinds = [r.kind for r in rows]
    assert kinds.count("steps") == 3 and kinds[-1] == "end" and "detection" in kinds
    chain = [part("a", RUN, steps=(1, 4)), part("b", RUN, steps=(5, 8), prev="a")]
    g = ledger_goodput_of(rows, chain)
    assert (g.productive_steps, g.redone_steps) == (8, 2)
    assert sum(g.seconds.values()) == pytest.approx(g.wall_s)
    assert g.seconds["productive"] == pytest.approx(2 * T, abs=T / 2)  # the save's time is not a step's
    assert g.seconds["redone"] == pytest.approx(0.8 * T, abs=T / 2)
    assert g.seconds["checkpoint_save"] >= 2 * T  # and the part's ledger file it wrote
    assert g.seconds["detection"] == pytest.approx(1.2 * T) and g.seconds["other"] == pytest.approx(0, abs=T / 2)
    assert ledger_goodput(ledger, "another-run") is None


def ledger_goodput_of(rows: list[TimelineRow], chain) -> object:
    return run_goodput(RUN, "pretrain", rows, chain)


def test_the_report_card_shows_each_stages_goodput_as_a_row_and_a_stacked_bar(tmp_path):
    from ghostvis_core.verify.eval.goodput_chart import goodput_chart
    from ghostvis_core.verify.eval.report_card import render_markdown, tables
    from tests.test_quality_gate import stage_card

    g = run_goodput(RUN, "pretrain", three_launches(), CHAIN).as_dict()
    cards = [stage_card("pretrain", goodput=g), stage_card("sft")]  # sft: a run with no timeline
    header, rows = tables(cards)["Goodput (the run's wall seconds by category, from the ledger's timeline)"]
    assert header[:4] == ["stage", "run", "goodput", "wall s"] and header[4:] == list(CATEGORIES)
    assert rows == [["pretrain", "pretrain-r1", round(42 / 117, 5), 117, 42, 8, 46, 3, 4, 2, 2, 5, 0, 5]]
    assert "![goodput per stage](goodput.png)" in render_markdown("t", cards, "loss.png", {})
    png = goodput_chart({"pretrain": g}, tmp_path / "goodput.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5_000


def test_two_launches_of_one_step_are_two_rows_and_its_finish_mark_ends_the_wall(tmp_path):
    """A step that launches again (after a preemption) writes a row per launch, and its finish mark (after its
    metadata) ends the wall: the time after the last launch is `other`."""
    store = FolderStore(tmp_path / "store")
    began = now_s()
    with recorded_launch(store, "pretrain", RUN, began):
        time.sleep(0.05)
    with pytest.raises(RuntimeError), recorded_launch(store, "pretrain", RUN, began):
        record_reason(store, "pretrain", RUN, 0, "RuntimeError: the job failed")  # rank 0 said why
        raise RuntimeError("the job failed")
    time.sleep(0.05)
    record_finish(store, "pretrain", RUN, began)
    rows = Ledger.in_store(store).timeline([RUN])
    assert [(r.kind, r.reason) for r in rows] == [("launch", "completed"), ("launch", "failed"), ("finish", "")]
    assert len({r.launch_id for r in rows}) == 3
    g = run_goodput(RUN, "pretrain", rows, CHAIN)
    assert g.launches == 2 and g.wall_s == pytest.approx(rows[2].start_s, abs=1e-3)
    assert g.seconds["other"] >= 0.05 and sum(g.seconds.values()) == pytest.approx(g.wall_s)

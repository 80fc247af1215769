"""Fenced commits (ghostvis_core/store/fence.py) on a folder store and on moto's S3 server, with holders on two
"nodes" (two store objects with their own caches) and in racing threads.

What these tests prove, and what they cannot: on the folder store, `create_json` is link(2), which the kernel makes
atomic, so the racing threads below exercise the real decision. moto's S3 server checks `If-None-Match` and then
writes without a lock, so two of its requests racing inside that window could both succeed; the S3 tests prove the
protocol (refusal after a newer fence, readers passing over refused records, one writer per number as moto
serialises them), not the atomicity of a real bucket's conditional PUT, which S3 itself guarantees."""

from __future__ import annotations

import re
import threading
import time

import pytest

from ghostvis_core.store import fence, lease


def _fence(store, generation: int, who: str) -> fence.Fence:
    return fence.Fence(store, "pretrain", "pretrain-abc", generation, {"host": who, "pid": generation})


def test_racing_committers_only_the_current_generations_commits_land(store_nodes):
    """Four threads commit under generation 1 while generation 2 takes the lease over at once: every commit of
    generation 1 that lands precedes the new fence in the log; every one after it is refused, naming both
    holders; generation 2's commits all land; readers see exactly the granted ones."""
    old = _fence(store_nodes.writer, 1, "node-a")
    old.take()
    landed: dict[str, int] = {}
    refused: list[str] = []
    start = threading.Barrier(5)

    def commit_old(t: int) -> None:
        mine = _fence(store_nodes.writer if t % 2 else store_nodes.reader, 1, "node-a")
        start.wait()
        for i in range(6):
            what = f"step_{t}_{i}"
            try:
                landed[what] = mine.commit("checkpoint_marker", "pretrain", "r1", what, text=what)
            except fence.LeaseLost as exc:
                refused.append(str(exc))
                return

    threads = [threading.Thread(target=commit_old, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    start.wait()
    new = _fence(store_nodes.reader, 2, "node-b")
    fenced_at = new.take()
    for t in threads:
        t.join()
    for i in range(3):
        new.commit("checkpoint_marker", "pretrain", "r1", f"new_{i}", text=f"new_{i}")

    assert all(n < fenced_at for n in landed.values()), (landed, fenced_at)
    assert len(landed) + len(refused) >= 4 and len(landed) < 24
    for said in refused:
        assert "generation 1 held by a launch (pid 1 on node-a)" in said
        assert "generation 2 was taken by a launch (pid 2 on node-b)" in said
    granted = fence.grants(store_nodes.writer, "pretrain", "pretrain-abc")
    for what in landed:
        assert granted.covers("checkpoint_marker", "pretrain", "r1", what, text=what)
    for i in range(3):
        assert granted.covers("checkpoint_marker", "pretrain", "r1", f"new_{i}", text=f"new_{i}")
    assert not granted.covers("checkpoint_marker", "pretrain", "r1", "new_0", text="other bytes")
    # after the fence, generation 1 can commit nothing at all
    with pytest.raises(fence.LeaseLost):
        _fence(store_nodes.writer, 1, "node-a").commit("run_record", "pretrain", "r1", text="{}")


def test_a_record_left_by_a_holder_that_lost_the_lease_is_not_committed(store_nodes):
    """The lost holder wrote its record before its grant was refused (and died before removing it): readers pass
    it over; the holder's own version is committed. A key never fenced is read as it is."""
    w = store_nodes.writer
    stale = lease.acquire(w, "sft", "sft-xyz", expiry_s=0.3)
    time.sleep(0.35)
    taker = lease.acquire(store_nodes.reader, "sft", "sft-xyz", expiry_s=0.3, poll_s=0.05, log=lambda _: None)
    w.write_text("run_record", "sft", "sft-xyz-r1", text='{"by": "stale"}')
    with pytest.raises(lease.LeaseLost):
        stale.fence.commit("run_record", "sft", "sft-xyz-r1", text='{"by": "stale"}')
    assert not fence.is_committed(w, "sft", "sft-xyz", "run_record", "sft", "sft-xyz-r1")
    w.write_text("run_record", "sft", "sft-xyz-r1", text='{"by": "taker"}')
    taker.fence.commit("run_record", "sft", "sft-xyz-r1", text='{"by": "taker"}')
    assert fence.is_committed(store_nodes.reader, "sft", "sft-xyz", "run_record", "sft", "sft-xyz-r1")
    w.write_text("run_record", "dpo", "never-fenced-r1", text="{}")
    assert fence.is_committed(w, "dpo", "never-fenced", "run_record", "dpo", "never-fenced-r1")


def test_a_holder_renews_a_stale_lease_before_it_acts_and_stops_once_it_was_taken_over(store_nodes):
    """A holder not renewed for half its expiry (a pause) renews before it commits: granted while nobody took
    over. Paused past the expiry and taken over, it learns so before anything is granted."""
    held = lease.acquire(store_nodes.writer, "pretrain", "pretrain-p", expiry_s=1.0)
    time.sleep(0.6)
    renewed = held.renewed_at
    assert held.hold() is None and held.renewed_at > renewed
    held.commit("run_record", "pretrain", "pretrain-p-r1", text="a")
    time.sleep(1.1)
    lease.acquire(store_nodes.reader, "pretrain", "pretrain-p", expiry_s=1.0, poll_s=0.05, log=lambda _: None)
    assert "taken over by a launch" in held.hold()
    with pytest.raises(lease.LeaseLost, match="taken over"):
        held.commit("run_record", "pretrain", "pretrain-p-r1", text="b")
    granted = fence.grants(store_nodes.reader, "pretrain", "pretrain-p")
    assert granted.covers("run_record", "pretrain", "pretrain-p-r1", text="a")
    assert not granted.covers("run_record", "pretrain", "pretrain-p-r1", text="b")


def test_a_holder_whose_store_does_not_answer_gives_the_lease_up_and_commits_nothing(tmp_path, monkeypatch):
    """The store stops answering (an S3 endpoint that refuses connections): the holder keeps trying for two
    expiries, then gives the lease up, naming the store's error; nothing is granted."""
    from ghostvis_core.store import FolderStore, S3Store

    held = lease.acquire(FolderStore(tmp_path / "store"), "sft", "sft-u", expiry_s=1.0)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    held.store = S3Store("unreachable", "store", tmp_path / "cache")
    time.sleep(0.6)
    started = time.monotonic()
    why = held.hold()
    assert time.monotonic() - started >= 1.0  # it waited for the store first
    assert re.search(r"not renewed for [23] s, the store unreachable \(EndpointConnectionError", why), why
    with pytest.raises(lease.LeaseLost, match="the store unreachable"):
        held.commit("run_record", "sft", "sft-u-r1", text="{}")
    assert fence.grants(FolderStore(tmp_path / "store"), "sft", "sft-u").granted == {}


def test_keep_alive_records_a_takeover_and_release_leaves_the_new_generation_alone(store_nodes):
    held = lease.acquire(store_nodes.writer, "sft", "sft-k", expiry_s=0.4)
    held.keep_alive()
    held._stop.set()  # its host freezes: no more beats
    held._thread.join()
    time.sleep(0.45)
    taker = lease.acquire(store_nodes.reader, "sft", "sft-k", expiry_s=0.4, poll_s=0.05, log=lambda _: None)
    with pytest.raises(lease.LeaseLost, match="taken over by a launch"):
        held.beat()
    assert held.lost and "taken over" in held.lost
    held.release()  # a lost holder says nothing about the lease
    assert lease.join(store_nodes.reader, "sft", "sft-k").number == taker.number

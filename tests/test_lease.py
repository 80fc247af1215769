"""Leases (ghostvis_core/store/lease.py): one holder at a time, on a folder store and on a bucket store (moto's
S3 server), with holders on two "nodes" (two store objects with their own caches) and in racing threads."""

from __future__ import annotations

import threading
import time

import pytest

from ghostvis_core.store import lease


def test_create_json_lets_exactly_one_of_many_racing_writers_create_a_record(store_nodes):
    """The store's compare-and-set: 8 threads over the two nodes create the same record at once; one wins."""
    won: list[int] = []
    start = threading.Barrier(8)

    def create(i: int) -> None:
        store = store_nodes.writer if i % 2 else store_nodes.reader
        start.wait()
        if store.create_json("lease", "pretrain", "race", "00000001", "holder", data={"who": i}):
            won.append(i)

    threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1
    assert store_nodes.reader.read_json("lease", "pretrain", "race", "00000001", "holder") == {"who": won[0]}
    assert not store_nodes.writer.create_json("lease", "pretrain", "race", "00000001", "holder", data={"who": -1})


def test_a_second_taker_waits_for_the_release_or_is_refused_naming_the_holder(store_nodes):
    first = lease.acquire(
        store_nodes.writer, "pretrain", "pretrain-abc", holder={"dagster_run_id": "1a2b3c4d5e"}, expiry_s=60
    )
    with pytest.raises(lease.LeaseHeld, match=r"pretrain pretrain-abc: held by Dagster run 1a2b3c4d \(pid \d+ on "):
        lease.acquire(store_nodes.reader, "pretrain", "pretrain-abc", expiry_s=60, wait=False)

    said: list[str] = []
    got: list[lease.Lease] = []
    waiter = threading.Thread(
        target=lambda: got.append(
            lease.acquire(store_nodes.reader, "pretrain", "pretrain-abc", expiry_s=60, poll_s=0.05, log=said.append)
        )
    )
    waiter.start()
    time.sleep(0.5)
    assert not got, "the second taker must wait while the first holds the lease"
    assert said == [said[0]] and "waiting for Dagster run 1a2b3c4d" in said[0]
    first.release()
    waiter.join(timeout=10)
    assert got and got[0].number == first.number + 1
    assert got[0].predecessor["dagster_run_id"] == "1a2b3c4d5e"  # its run's outcome is the waiter's to look at
    assert not any("took over" in s for s in said), "a released lease is taken, not taken over"


def test_a_holder_that_stopped_beating_is_taken_over_and_learns_it_lost_the_lease(store_nodes):
    stale = lease.acquire(store_nodes.writer, "tokenizer", "tok-1", expiry_s=0.3)
    stale.beat()
    said: list[str] = []
    started = time.monotonic()
    taker = lease.acquire(store_nodes.reader, "tokenizer", "tok-1", expiry_s=0.3, poll_s=0.05, log=said.append)
    assert time.monotonic() - started >= 0.2  # it waited until the heartbeat was older than the expiry
    assert taker.number == 2 and any("took over the lease from a launch" in s for s in said)
    assert taker.predecessor is None  # a holder that died did nothing more: nothing to wait for
    with pytest.raises(lease.LeaseLost, match="tokenizer/tok-1: taken over by a launch"):
        stale.beat()


def test_a_kept_alive_lease_outlives_its_expiry_and_join_finds_it(store_nodes):
    held = lease.acquire(store_nodes.writer, "sft", "sft-xyz", expiry_s=0.4)
    held.keep_alive()
    try:
        time.sleep(1.0)  # 2.5 expiries: only the heartbeat keeps it
        with pytest.raises(lease.LeaseHeld):
            lease.acquire(store_nodes.reader, "sft", "sft-xyz", expiry_s=0.4, wait=False)
        joined = lease.join(store_nodes.reader, "sft", "sft-xyz")
        assert joined is not None and joined.number == held.number and not joined.owned
    finally:
        held.release()
    assert lease.join(store_nodes.reader, "sft", "sft-xyz") is None

"""A lease is renewed only while what it is held for makes progress (store/lease.py `renewed_while`, `waiting`):
the launching side renews a job's run identity only while the job's ranks move their heartbeats (the launcher's
frozen-job watch, runs/heartbeats.py FrozenJobWatch), so a frozen job gives it up; and a job's own wait for its
lease's renewal is a phase of its progress watchdog with its own budget. Real rank processes (stopped with
SIGSTOP, a frozen node), a real folder store, a store read that never returns (a FIFO: a hung file server)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ghostvis_core.run.train.watchdog import HUNG_EXIT, Watchdog
from ghostvis_core.runs.heartbeats import FrozenJobWatch
from ghostvis_core.store import FolderStore, lease

RUN = "pretrain-f-r1"
TIMEOUT_S, EXPIRY_S = 1.6, 0.8
TRAINING = f"""
import sys, time
from ghostvis_core.run.train.watchdog import Watchdog
from ghostvis_core.store import FolderStore
dog = Watchdog(FolderStore(sys.argv[1]), "pretrain", "{RUN}", int(sys.argv[2]), 2, timeout_s={TIMEOUT_S})
dog.start(0)
print("beating", flush=True)
for step in range(1, 100000):  # a step every 0.1 s
    time.sleep(0.1)
    dog.progress(step)
"""


def beating_ranks(store_dir: Path) -> list[subprocess.Popen]:
    """Two rank processes that train (a step every 0.1 s) and whose watchdogs beat into `store_dir` every
    timeout/8, once they said so."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    ranks = [
        subprocess.Popen([sys.executable, "-c", TRAINING, str(store_dir), str(r)], env=env, stdout=subprocess.PIPE)
        for r in (0, 1)
    ]
    for proc in ranks:
        assert proc.stdout.readline() == b"beating\n"
    return ranks


def test_the_launching_side_renews_the_run_lease_only_while_the_jobs_heartbeats_move(tmp_path):
    """While the ranks beat, the launching process's keep-alive renews the lease past its expiry and a second
    launch is refused; once both ranks are frozen, the renewal stops after the hang timeout (saying why), the lease
    expires, and a second launch takes it over within the hang timeout plus one expiry (and a beat or two)."""
    store = FolderStore(tmp_path / "store")
    held = lease.acquire(store, "pretrain", "pretrain-f", holder={"dagster_run_id": "1a2b3c4d5e"}, expiry_s=EXPIRY_S)
    held.keep_alive()
    ranks = beating_ranks(tmp_path / "store")
    try:
        with held.renewed_while(FrozenJobWatch(store, "pretrain", RUN, 2, timeout_s=TIMEOUT_S).frozen):
            time.sleep(3 * EXPIRY_S)  # past the expiry: only renewals keep it
            with pytest.raises(lease.LeaseHeld, match=r"pretrain pretrain-f: held by Dagster run 1a2b3c4d "):
                lease.acquire(store, "pretrain", "pretrain-f", expiry_s=EXPIRY_S, wait=False)
            assert held.withheld is None
            for proc in ranks:
                os.kill(proc.pid, signal.SIGSTOP)
            frozen_at, taken, said = time.time(), None, []
            while taken is None and time.time() < frozen_at + 30:
                try:
                    taken = lease.acquire(
                        store, "pretrain", "pretrain-f", expiry_s=EXPIRY_S, wait=False, log=said.append
                    )
                except lease.LeaseHeld:
                    time.sleep(0.05)
            waited = time.time() - frozen_at
            withheld = held.withheld
    finally:
        for proc in ranks:
            proc.kill()
            proc.wait()
    assert taken is not None and TIMEOUT_S <= waited <= TIMEOUT_S + EXPIRY_S + 2.0, waited
    assert re.fullmatch(
        r"hung: no heartbeat of run pretrain-f-r1 moved for \d s \(runtime.hang_timeout_s=1.6\): .*", withheld
    )
    assert len(said) == 1 and said[0].startswith("pretrain pretrain-f: took over the lease from Dagster run 1a2b3c4d")
    deadline = time.time() + 10  # out of the job's block the keep-alive renews again: it finds the takeover
    while held.lost is None and time.time() < deadline:
        time.sleep(0.05)
    held.release()
    assert held.lost and held.lost.startswith(
        f"lease pretrain/pretrain-f: taken over by a launch (pid {os.getpid()} on "
    )
    taken.release()


def test_a_jobs_wait_for_its_lease_renewal_is_a_watchdog_phase_with_its_own_budget(tmp_path):
    """Rank 0's lease is due for renewal and the store hangs on a read (a FIFO where a beat record is): `hold`
    blocks, inside the watchdog's phase, which ends the job when the phase's budget (HOLD_BUDGET_EXPIRIES expiries)
    is spent, long before the hang timeout, naming the wait."""
    store = FolderStore(tmp_path / "store")
    held = lease.acquire(store, "pretrain", "pretrain-l", expiry_s=0.4)
    exits: list[int] = []
    dog = Watchdog(store, "pretrain", "pretrain-l-r1", 0, 1, timeout_s=30.0, exit_fn=exits.append)
    held.waiting = dog.in_phase
    hung = tmp_path / "store" / "leases" / "pretrain" / "pretrain-l" / held.generation / "beat-nfs-1.json"
    os.mkfifo(hung)
    dog.start(12)
    time.sleep(0.3)  # the renewal is older than SAFE_SHARE of the expiry: `hold` must renew first
    holding = threading.Thread(target=held.hold, daemon=True)
    started = time.time()
    holding.start()
    budget = lease.HOLD_BUDGET_EXPIRIES * held.expiry_s
    while not exits and time.time() < started + 20:
        time.sleep(0.05)
    fired_after = time.time() - started
    with open(hung, "w") as fifo:  # the file server answers at last (and the record goes): `hold` renews and ends
        hung.unlink()
        fifo.write('{"time": 0}')
    holding.join(timeout=10)
    dog.stop()
    assert exits == [HUNG_EXIT] and budget <= fired_after <= budget + 30.0 / 8 + 1.0, fired_after
    assert re.search(
        rf"^hung: rank 0 on {re.escape(dog.host)} was in the wait for a renewal of lease pretrain/pretrain-l for \d s, "
        r"past its budget of 1.2 s \(runtime.hang_timeout_s=30\), waiting in the wait for a renewal of lease "
        "pretrain/pretrain-l; ",
        dog.fired,
    ), dog.fired
    assert not holding.is_alive()

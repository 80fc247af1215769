"""The Dagster side of leases (ghostvis_core/store/lease.py): a materialization that writes shared state holds
the lease on what it writes while it runs, names the launch it waits for in the run log, and fails without a
retry when told not to wait (waiting again would find the same holder) or when it lost the lease while it ran
(another launch took it over: that one's records are the run's now, and nothing of this one's is checked)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from dagster import Failure

from ghostvis_core.plan.config import RuntimeConfig
from ghostvis_core.store import Store
from ghostvis_core.store.lease import Lease, LeaseHeld, acquire, clock

# how long a launch that waited for a lease waits, after it, for the holder's Dagster run to record its checks
HOLDER_RUN_WAIT_S = 1800.0


@contextmanager
def run_lease(
    context, store: Store, scope: str, name: str, wait: bool = True, expiry_s: float = RuntimeConfig.lease_expiry_s
) -> Iterator[Lease]:
    """Hold the lease on `scope/name` (a stage and its run identity, or a data artifact) for the block. A lease
    taken after another Dagster run's is given back until that run ended: its asset checks are recorded after
    its asset released the lease (and its retry takes the lease again), and the cache only reuses a run whose
    checks passed."""
    holder = {"dagster_run_id": context.run_id, "asset": context.asset_key.to_user_string()}
    began = clock()
    while True:
        try:
            lease = acquire(store, scope, name, holder=holder, expiry_s=expiry_s, wait=wait, log=context.log.info)
        except LeaseHeld as exc:
            raise Failure(description=str(exc), allow_retries=False) from None
        other = (lease.predecessor or {}).get("dagster_run_id")
        if not other or other == context.run_id or run_finished(context, other):
            break
        lease.release()
        wait_for_run_end(context, other)
    lease.waited = (began, clock())  # the waits for the holder's Dagster run too
    lease.keep_alive()
    try:
        yield lease
        lost = lease.lost
    finally:
        lease.release()
    if lost:
        raise Failure(description=f"{scope} {name}: {lost}", allow_retries=False)


def run_finished(context, run_id: str) -> bool:
    run = context.instance.get_run_by_id(run_id)
    return run is None or run.is_finished


def wait_for_run_end(context, run_id: str, poll_s: float = 0.5) -> None:
    """Until the Dagster run `run_id` finished (or is gone, or HOLDER_RUN_WAIT_S passed)."""
    context.log.info(f"waiting for Dagster run {run_id[:8]} to end (it trained this; its checks decide a cache hit)")
    deadline = time.monotonic() + HOLDER_RUN_WAIT_S
    while time.monotonic() < deadline and not run_finished(context, run_id):
        time.sleep(poll_s)

"""The Dagster side of leases (ghostvis_core/store/lease.py): a materialization that writes shared state holds
the lease on what it writes while it runs, names the launch it waits for in the run log, and fails without a
retry when told not to wait (waiting again would find the same holder)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from dagster import Failure

from ghostvis_core.store import Store
from ghostvis_core.store.lease import LeaseHeld, held

# how long a launch that waited for a lease waits, after it, for the holder's Dagster run to record its checks
HOLDER_RUN_WAIT_S = 1800.0


@contextmanager
def run_lease(context, store: Store, scope: str, name: str, wait: bool = True) -> Iterator[None]:
    """Hold the lease on `scope/name` (a stage and its run identity, or a data artifact) for the block. After
    waiting for another Dagster run's lease, also wait for that run to end: its asset checks are recorded after
    its asset released the lease, and the cache only reuses a run whose checks passed."""
    try:
        with held(
            store,
            scope,
            name,
            holder={"dagster_run_id": context.run_id, "asset": context.asset_key.to_user_string()},
            wait=wait,
            log=context.log.info,
        ) as lease:
            other = (lease.predecessor or {}).get("dagster_run_id")
            if other and other != context.run_id:
                wait_for_run_end(context, other)
            yield
    except LeaseHeld as exc:
        raise Failure(description=str(exc), allow_retries=False) from None


def wait_for_run_end(context, run_id: str, poll_s: float = 0.5) -> None:
    """Until the Dagster run `run_id` finished (or is gone, or HOLDER_RUN_WAIT_S passed)."""
    deadline = time.monotonic() + HOLDER_RUN_WAIT_S
    told = False
    while time.monotonic() < deadline:
        run = context.instance.get_run_by_id(run_id)
        if run is None or run.is_finished:
            return
        if not told:
            context.log.info(f"waiting for Dagster run {run_id[:8]} to record its checks")
            told = True
        time.sleep(poll_s)

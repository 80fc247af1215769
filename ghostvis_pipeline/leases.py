"""The Dagster side of leases (ghostvis_core/store/lease.py): a materialization that writes shared state holds
the lease on what it writes while it runs, names the launch it waits for in the run log, and fails without a
retry when told not to wait (waiting again would find the same holder)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from dagster import Failure

from ghostvis_core.store import Store
from ghostvis_core.store.lease import LeaseHeld, held


@contextmanager
def run_lease(context, store: Store, scope: str, name: str, wait: bool = True) -> Iterator[None]:
    """Hold the lease on `scope/name` (a stage and its run identity, or a data artifact) for the block."""
    try:
        with held(
            store,
            scope,
            name,
            holder={"dagster_run_id": context.run_id, "asset": context.asset_key.to_user_string()},
            wait=wait,
            log=context.log.info,
        ):
            yield
    except LeaseHeld as exc:
        raise Failure(description=str(exc), allow_retries=False) from None

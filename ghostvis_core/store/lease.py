"""Leases: one writer at a time for a shared thing (a stage run identity, a tokenizer, a shard's tokenization),
across processes, hosts and launchers, through the store alone.

Two launches of one stage run identity (two people pressing Materialize, a backfill beside a CLI run, a sensor
and a retry) would otherwise both train into the same run key, and the ledger would show one of them. Before
anything is written, the launch takes the identity's lease; a second launch waits for it and then finds the
finished run (a cache hit), or with `wait=False` stops at once naming the holder.

A lease is a sequence of generations under `leases/<scope>/<name>/<generation>/` (artifact kind `lease`):
- `holder.json`, created with the store's one compare-and-set (`Store.create_json`: O_EXCL-style link on a
  folder, `If-None-Match: *` on S3), says who holds generation N: host, pid, Dagster run (if any), expiry;
  whoever creates generation N+1 first holds the lease, every other creator gets False and looks again;
- `beat-<host>-<pid>.json`, rewritten every `expiry_s / 4` by each process keeping it alive (the launching
  process, and the job's rank 0, which may outlive it on a cluster): the newest beat is the heartbeat;
- `released.json`, written when the holder is done.
The newest generation is free when it is released or its heartbeat is older than its expiry (its holder died:
the next taker logs the takeover, naming the old holder and the heartbeat's age). Times are the hosts' clocks
(UTC seconds): hosts of one cluster are expected to keep them within a few seconds of each other.

A holder stops before anyone may take over: it treats its lease as valid only while its last successful renewal
is younger than `SAFE_SHARE` of the expiry on its own clock (`Lease.hold`), so a holder cut off from the store, or
paused, stops training and committing by the time a taker may see it expired, until a renewal says whether it
still holds the lease (a short outage costs a wait) or lost it (a takeover: it stops for good). The one thing
that clock cannot see (a pause between the check and a write) is what the fence catches: every commit made under
the lease is granted by its fence log (store/fence.py), where a newer generation's fence refuses it.

A holder renews only while what it holds the lease for makes progress: the launching process, while its job runs,
renews only while the job's ranks move their heartbeats (`renewed_while`, with the launcher's frozen-job watch), so a
job frozen with its node (no rank can report, nothing can stop it) holds the run identity for at most the hang
timeout and one expiry; then another launch may take it over, and the fence refuses the frozen job's commits should
it ever wake. And a job's wait for its own renewal (`hold` blocking, the store unreachable) is a phase of its
progress watchdog (`waiting`) with its own budget, `HOLD_BUDGET_EXPIRIES` expiries: past it, the watchdog ends the
job naming the wait.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from ghostvis_core.errors import GhostvisError
from ghostvis_core.store.fence import Fence, LeaseLost, describe_holder
from ghostvis_core.store.protocol import Store

HOLDER, RELEASED = "holder", "released"
# the share of the expiry a holder's last renewal may be old before it takes its lease for lost: a taker waits a
# whole expiry on its own clock, so hosts' clocks may differ by up to half an expiry without two holders at once
SAFE_SHARE = 0.5
UNREACHABLE_EXPIRIES = 2  # how long a holder waits for a store that does not answer before it gives its lease up
RETRY_S = 1.0  # how often a holder tries a store that does not answer
TAKER_GAP_S = 1.0  # after a renewal older than the expiry, how long a taker's read-then-create may still land
HOLD_BUDGET_EXPIRIES = UNREACHABLE_EXPIRIES + 1  # a blocked `hold` gives up by itself within this, store calls aside


class LeaseHeld(GhostvisError):
    """The lease is held by a live holder and the caller chose not to wait."""


def _me() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def describe(holder: dict[str, Any], age_s: float) -> str:
    """'Dagster run 1a2b3c4d (pid 812 on node-3), heartbeat 4 s ago'."""
    return f"{describe_holder(holder)}, heartbeat {age_s:.0f} s ago"


def clock() -> float:
    """This host's clock for a holder's own renewals: CLOCK_BOOTTIME where there is one (it goes on while the
    machine is suspended, as the other hosts' clocks do), else the monotonic clock."""
    return time.clock_gettime(time.CLOCK_BOOTTIME) if hasattr(time, "CLOCK_BOOTTIME") else time.monotonic()


@dataclass
class Generation:
    """One generation of a lease as the store holds it now."""

    number: int
    holder: dict[str, Any]
    released: bool
    heartbeat: float  # the newest beat (or the holder's creation time), UTC seconds

    def age_s(self, now: float) -> float:
        return max(0.0, now - self.heartbeat)

    def live(self, now: float) -> bool:
        return not self.released and self.age_s(now) <= float(self.holder["expiry_s"])


def newest_generation(store: Store, scope: str, name: str) -> Generation | None:
    keys = store.keys("lease", scope, name)
    numbers = sorted({int(k[2]) for k in keys if k[2].isdigit()})
    for number in reversed(numbers):  # a generation whose holder.json is not readable yet is skipped
        gen = f"{number:08d}"
        files = {k[3] for k in keys if k[2] == gen}
        if HOLDER not in files:
            continue
        holder = store.read_json("lease", scope, name, gen, HOLDER)
        beats = [holder.get("time", 0.0)]
        for f in sorted(files):
            if f.startswith("beat-"):
                try:
                    beats.append(store.read_json("lease", scope, name, gen, f)["time"])
                except GhostvisError:  # rewritten while we read it
                    continue
        return Generation(number, holder, RELEASED in files, max(beats))
    return None


@dataclass
class Lease:
    """A generation this process holds (or joined, as a job of the launch that holds it), and its right to
    commit (`commit`, through the generation's fence)."""

    store: Store
    scope: str
    name: str
    number: int
    holder: dict[str, Any]
    owned: bool = False  # taken by this process (released by it), not joined
    # the holder this one waited for until it released the lease: what it did meanwhile may be this one's to
    # reuse (not one taken over: a holder that died did nothing more)
    predecessor: dict[str, Any] | None = None
    renewed_at: float = field(default_factory=clock)  # the last successful renewal, on this host's `clock`
    # the taker's wait for it: when it began to look and when it took it, on this host's `clock` (None: joined)
    waited: tuple[float, float] | None = None
    lost: str | None = None  # why this process no longer holds it, once it knows
    # while set: why what this lease is held for stopped making progress (None while it makes some); the keep-alive
    # does not renew meanwhile (`renewed_while`)
    stalled: Callable[[], str | None] | None = field(default=None, repr=False)
    # a phase of the job's progress watchdog (name, budget in seconds) around a `hold` that must renew first
    waiting: Callable[[str, float], AbstractContextManager] | None = field(default=None, repr=False)
    withheld: str | None = None  # why the keep-alive's last turn did not renew, None when it renewed
    fence: Fence = field(init=False, repr=False)
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.fence = Fence(self.store, self.scope, self.name, self.number, self.holder)

    @property
    def generation(self) -> str:
        return f"{self.number:08d}"

    @property
    def expiry_s(self) -> float:
        return float(self.holder["expiry_s"])

    def beat(self) -> None:
        """Renew the heartbeat; a takeover by another holder (this one looked dead) is `LeaseLost` naming it."""
        started = clock()
        newest = newest_generation(self.store, self.scope, self.name)
        if newest is not None and newest.number != self.number:
            self.lost = (
                f"lease {self.scope}/{self.name}: taken over by {describe_holder(newest.holder)} while this process "
                f"held it (its heartbeat was older than {self.expiry_s:.0f} s: was this host paused, or the store "
                "unreachable?); this launch stops: the new holder resumes the run from its newest checkpoint"
            )
            raise LeaseLost(self.lost)
        self.store.write_json(
            "lease", self.scope, self.name, self.generation, f"beat-{_me()}", data={"time": time.time()}
        )
        self.renewed_at = started

    def hold(self) -> str | None:
        """None once this process may act as the holder, else why not. Its lease counts only while the last renewal
        is younger than `SAFE_SHARE` of the expiry on its own clock; an older one (the store unreachable, or this
        process paused) is renewed here first, blocking, so nothing trains or commits meanwhile: a renewal that
        finds another generation is a takeover (`lost`), and a store unreachable for `UNREACHABLE_EXPIRIES`
        expiries gives the lease up (another launch may hold it by the time the store answers). That wait is the
        `waiting` phase, named, with a budget of `HOLD_BUDGET_EXPIRIES` expiries."""
        if self.lost is None and clock() - self.renewed_at > SAFE_SHARE * self.expiry_s:
            phase = f"the wait for a renewal of lease {self.scope}/{self.name}"
            with nullcontext() if self.waiting is None else self.waiting(phase, HOLD_BUDGET_EXPIRIES * self.expiry_s):
                self._renew()
        return self.lost

    def _renew(self) -> None:
        """`hold`'s renewal: until it lands, the lease is lost, or the store stayed unreachable too long."""
        while self.lost is None and (age := clock() - self.renewed_at) > SAFE_SHARE * self.expiry_s:
            try:
                self.beat()
                if age > self.expiry_s:  # a taker may have read the old heartbeat just before this beat
                    time.sleep(TAKER_GAP_S)
                    self.beat()
            except LeaseLost:
                break
            except Exception as exc:  # the store does not answer
                if age > UNREACHABLE_EXPIRIES * self.expiry_s:
                    self.lost = (
                        f"lease {self.scope}/{self.name}: not renewed for {age:.0f} s, the store unreachable "
                        f"({type(exc).__name__}: {exc}); another launch may take it over once the store answers, "
                        "so this launch stops; materialize the stage again to resume from the newest checkpoint"
                    )
                    break
                time.sleep(RETRY_S)

    def commit(self, kind: str, *key: str, text: str) -> None:
        """Grant the record (kind, key) just written with bytes `text`, through the fence; `LeaseLost` (nothing
        granted) when this process lost the lease or a newer generation fenced it out."""
        why = self.hold()
        if why:
            raise LeaseLost(why)
        try:
            self.fence.commit(kind, *key, text=text)
        except LeaseLost as exc:
            self.lost = str(exc)
            raise

    @contextmanager
    def renewed_while(self, stalled: Callable[[], str | None]) -> Iterator[None]:
        """Within the block the keep-alive renews only while `stalled()` says None (what the lease is held for
        makes progress); a renewal it withheld is said in `withheld`."""
        self.stalled = stalled
        try:
            yield
        finally:
            self.stalled, self.withheld = None, None

    def keep_alive(self) -> None:
        """Beat every expiry/4 on a daemon thread until `release` (or `stop`), every `RETRY_S` while the store does
        not answer, none while `stalled` says why (`renewed_while`); a takeover ends it with `lost` set."""

        def run() -> None:
            wait = self.expiry_s / 4
            while not self._stop.wait(wait):
                stalled = self.stalled
                try:
                    self.withheld = stalled() if stalled is not None else None
                    if self.withheld:
                        continue
                    self.beat()
                    wait = self.expiry_s / 4
                except LeaseLost:
                    return
                except Exception:  # the store is down for a moment: try again soon
                    wait = min(RETRY_S, self.expiry_s / 4)

        self._thread = threading.Thread(target=run, name=f"lease-{self.scope}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def release(self) -> None:
        """Stop beating and, unless this process lost it, say the lease is free."""
        self.stop()
        if self.lost is None:
            self.store.write_json(
                "lease", self.scope, self.name, self.generation, RELEASED, data={"time": time.time(), "by": _me()}
            )


def acquire(
    store: Store,
    scope: str,
    name: str,
    *,
    holder: dict[str, Any] | None = None,
    expiry_s: float,
    wait: bool = True,
    poll_s: float = 1.0,
    log: Callable[[str], None] = print,
) -> Lease:
    """Take the lease on `scope/name`: at once when it is free, after its holder releases it or stops beating
    when `wait`, else `LeaseHeld` naming the holder. What the holder writes is logged once while waiting; the
    lease's `waited` is the span from this call to the take (a launch's time waiting, not starting up)."""
    record = {**(holder or {}), "host": socket.gethostname(), "pid": os.getpid(), "expiry_s": expiry_s}
    told, waited_for, began = None, None, clock()
    while True:
        now = time.time()
        newest = newest_generation(store, scope, name)
        if newest is not None and newest.live(now):
            waited_for = newest.holder
            if not wait:
                raise LeaseHeld(
                    f"{scope} {name}: held by {describe(newest.holder, newest.age_s(now))}; wait for it (without "
                    "--no-wait / run config wait: false), or terminate that launch"
                )
            if told != newest.number:
                log(f"{scope} {name}: waiting for {describe(newest.holder, newest.age_s(now))} to finish")
                told = newest.number
            time.sleep(poll_s)
            continue
        number = newest.number + 1 if newest else 1
        mine = {**record, "time": time.time()}
        if store.create_json("lease", scope, name, f"{number:08d}", HOLDER, data=mine):
            taken = Lease(store, scope, name, number, mine, owned=True)
            try:
                taken.fence.take()  # before anything is written under it
            except LeaseLost:  # a newer generation was taken meanwhile: look again
                continue
            if newest is not None and not newest.released:
                log(
                    f"{scope} {name}: took over the lease from {describe(newest.holder, newest.age_s(now))}: "
                    f"no heartbeat for longer than its expiry ({float(newest.holder['expiry_s']):.0f} s); its "
                    "commits from now on are refused"
                )
            _prune(store, scope, name, keep_from=number - 1)
            if newest is not None and newest.released:
                taken.predecessor = waited_for
            taken.waited = (began, clock())
            return taken
        # another launch created that generation first: look again


def join(store: Store, scope: str, name: str) -> Lease | None:
    """The live generation of `scope/name`, for a job its holder launched to beat while it runs (a job on a
    cluster may outlive the process that launched it); None when nobody holds it (a plain torchrun launch)."""
    newest = newest_generation(store, scope, name)
    if newest is None or not newest.live(time.time()):
        return None
    return Lease(store, scope, name, newest.number, newest.holder)


def _prune(store: Store, scope: str, name: str, keep_from: int) -> None:
    """Generations older than the one just superseded (their folders would only grow)."""
    for key in store.keys("lease", scope, name):
        if key[2].isdigit() and int(key[2]) < keep_from:
            store.delete("lease", *key)

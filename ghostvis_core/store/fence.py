"""Fenced commits: a lease's generation is the fencing token of every commit made under it.

A lease (store/lease.py) says who may write, but it cannot stop a holder that was paused past its expiry (a
frozen VM, a stop-the-world pause, a network partition) from waking up and writing after another launch took
over. So every commit that decides what a run or a data artifact is goes through the lease's fence log,
`leases/<scope>/<name>/log/<n>.json` (artifact kind `fence_log`), an append-only sequence of entries:

- a holder that takes the lease appends a `fence` entry with its generation before it writes anything;
- a commit appends a `commit` entry naming the record it commits (kind and key) and the sha256 of its bytes.

Every entry is created with the store's one atomic operation, `create_json` at the next free number (a hard
link that fails on an existing name on a folder store, a conditional `If-None-Match: *` PUT on S3). An entry at
number n lands only if nobody created n first, and its writer has read every entry before n: so a commit entry
lands only while no fence of a newer generation precedes it. The store decides; no check followed by a separate
write decides anything.

A commit writes its record first (a checkpoint's COMPLETE marker, the run record) and appends its entry second,
so a granted entry always names a record that is whole. A holder whose entry is refused removes what it wrote
and stops (`LeaseLost`). Readers take a fenced record as committed only when a granted entry names its bytes
(`Grants.covers`), so a record left by a holder that lost the lease (and died before removing it) is passed
over. Where nothing was ever fenced (no log: an imported model, a record written without a lease) there is
nothing to check.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from ghostvis_core.errors import GhostvisError
from ghostvis_core.store.protocol import Store

FENCE, COMMIT = "fence", "commit"


class LeaseLost(GhostvisError):
    """This process no longer holds the lease it would commit under: another launch took it over (this one was
    paused, or its store unreachable, past the lease's expiry). Nothing more may be committed: the job stops."""


def record_digest(text: str) -> str:
    """The sha256 of a record's bytes as the store holds them (what a commit entry names)."""
    return hashlib.sha256(text.encode()).hexdigest()


def what_of(kind: str, key: tuple[str, ...]) -> str:
    return "/".join((kind, *key))


@dataclass(frozen=True)
class Entry:
    """One entry of a fence log."""

    number: int
    kind: str  # FENCE or COMMIT
    generation: int
    holder: dict[str, Any]
    what: str = ""  # COMMIT: "<artifact kind>/<key parts>"
    sha256: str = ""  # COMMIT: the committed record's bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "generation": self.generation,
            "holder": self.holder,
            "what": self.what,
            "sha256": self.sha256,
        }

    @classmethod
    def from_dict(cls, number: int, d: dict[str, Any]) -> Entry:
        return cls(number, d["kind"], int(d["generation"]), d.get("holder", {}), d.get("what", ""), d.get("sha256", ""))


def read_entry(store: Store, scope: str, name: str, number: int) -> Entry:
    return Entry.from_dict(number, store.read_json("fence_log", scope, name, f"{number:08d}"))


def read_log(store: Store, scope: str, name: str) -> list[Entry]:
    """Every entry of the log of `scope/name`, in order."""
    numbers = sorted(int(k[2]) for k in store.keys("fence_log", scope, name) if k[2].isdigit())
    return [read_entry(store, scope, name, n) for n in numbers]


@dataclass(frozen=True)
class Grants:
    """What a fence log grants: per record (kind and key), the sha256 of every granted version of its bytes."""

    granted: dict[str, frozenset[str]]

    def covers(self, kind: str, *key: str, text: str) -> bool:
        return record_digest(text) in self.granted.get(what_of(kind, key), frozenset())


def grants(store: Store, scope: str, name: str) -> Grants | None:
    """The granted commits of `scope/name`, read again from its log (an entry after a newer generation's fence
    grants nothing); None when nothing was ever fenced there."""
    entries = read_log(store, scope, name)
    if not entries:
        return None
    newest, granted = 0, {}
    for e in entries:
        if e.kind == FENCE:
            newest = max(newest, e.generation)
        elif e.generation >= newest:
            granted.setdefault(e.what, set()).add(e.sha256)
    return Grants({k: frozenset(v) for k, v in granted.items()})


def is_committed(store: Store, scope: str, name: str, kind: str, *key: str) -> bool:
    """Record (kind, key) exists and, where `scope/name` is fenced, a granted commit names its bytes."""
    if not store.exists(kind, *key):
        return False
    found = grants(store, scope, name)
    return found is None or found.covers(kind, *key, text=store.read_text(kind, *key))


def describe_holder(holder: dict[str, Any]) -> str:
    who = f"Dagster run {holder['dagster_run_id'][:8]}" if holder.get("dagster_run_id") else "a launch"
    return f"{who} (pid {holder.get('pid')} on {holder.get('host')})"


@dataclass
class Fence:
    """A holder's right to commit under generation `generation` of the lease on `scope/name`. `cursor`: the
    log's entries up to it were read, and none fences this generation out."""

    store: Store
    scope: str
    name: str
    generation: int
    holder: dict[str, Any]
    cursor: int = field(default=0)

    def take(self) -> int:
        """Append this generation's fence entry (a holder that just took the lease, before it writes)."""
        entries = read_log(self.store, self.scope, self.name)
        for e in entries:
            self._refuse_if_newer(e, "take the lease")
        self.cursor = entries[-1].number if entries else 0
        return self._append(Entry(0, FENCE, self.generation, self.holder))

    def commit(self, kind: str, *key: str, text: str) -> int:
        """Grant the record (kind, key) whose bytes are `text`, already written: refused (`LeaseLost`, naming
        both holders) once a newer generation fenced this one out."""
        what = what_of(kind, key)
        return self._append(Entry(0, COMMIT, self.generation, self.holder, what, record_digest(text)), what)

    def _append(self, entry: Entry, what: str = "the lease") -> int:
        while True:
            number = self.cursor + 1
            if self.store.create_json("fence_log", self.scope, self.name, f"{number:08d}", data=entry.to_dict()):
                self.cursor = number
                return number
            self._refuse_if_newer(read_entry(self.store, self.scope, self.name, number), f"commit {what}")
            self.cursor = number

    def _refuse_if_newer(self, e: Entry, doing: str) -> None:
        if e.kind == FENCE and e.generation > self.generation:
            raise LeaseLost(
                f"lease {self.scope}/{self.name}: generation {self.generation} held by "
                f"{describe_holder(self.holder)} may no longer {doing}: generation {e.generation} was taken by "
                f"{describe_holder(e.holder)}; this launch stops, the new holder goes on from the newest "
                "committed checkpoint"
            )

"""A job's heartbeats as the launching side reads them: each rank's watchdog (run/train/watchdog.py) writes
`run_file <stage> <run_key> heartbeats/rank<r>.json` every eighth of the hang timeout, and the launcher's
`FrozenJobWatch` reads them for what no rank can report: a node whose torchrun and ranks are all stopped (a paused
VM, a stalled kernel). A record of the run, so it lives here, below both the job and the launchers."""

from __future__ import annotations

import time

from ghostvis_core.runs.reasons import HUNG
from ghostvis_core.store import Store

STOPPED = "stopped"  # a heartbeat's phase once its rank stopped watching (the loop ended)


def heartbeat_name(rank: int) -> str:
    """The run file rank `rank`'s watchdog beats into."""
    return f"heartbeats/rank{rank}.json"


class FrozenJobWatch:
    """The launching side's watch over a job's heartbeats (`run_file <stage> <run_key> heartbeats/rank<r>.json`),
    for what no rank can report: a node whose torchrun and ranks are all stopped. Armed once a heartbeat moved
    during this launch (an earlier launch's are passed over, and a job still starting writes none); `frozen`
    returns the reason once the store answers and no heartbeat moved for `timeout_s` on this host's clock, None
    otherwise (also once every rank stopped watching: the run is finishing)."""

    def __init__(self, store: Store, stage: str, run_key: str, world_size: int, timeout_s: float):
        self.store, self.stage, self.run_key = store, stage, run_key
        self.world_size, self.timeout_s = world_size, timeout_s
        self.beats = self._read()  # what an earlier launch left
        self.moved: float | None = None  # this host's clock when a heartbeat last moved; None: not armed
        self.read_at = time.monotonic()

    def _read(self) -> dict[int, dict]:
        out = {}
        for r in range(self.world_size):
            name = heartbeat_name(r)
            if self.store.exists("run_file", self.stage, self.run_key, name):
                out[r] = self.store.read_json("run_file", self.stage, self.run_key, name)
        return out

    def frozen(self) -> str | None:
        """The store is read at most every timeout/8; between reads the answer stands on the last one."""
        now = time.monotonic()
        if self.timeout_s <= 0:
            return None
        if now - self.read_at >= self.timeout_s / 8:
            self.read_at = now
            try:
                beats = self._read()
            except Exception:  # the store does not answer: nothing is known to have stopped (nor beats: the ranks')
                return None
            if beats != self.beats:
                self.beats, self.moved = beats, now
        finishing = all(b["phase"] == STOPPED for b in self.beats.values())
        if self.moved is None or finishing or now - self.moved <= self.timeout_s:
            return None
        return self.reason(now - self.moved)

    def reason(self, still_s: float) -> str:
        hosts: dict[str, list[dict]] = {}
        for beat in self.beats.values():
            hosts.setdefault(beat["host"], []).append(beat)
        nodes = "; ".join(
            f"node {host} (ranks {', '.join(str(b['rank']) for b in bs)}, last step reported "
            f"{max(b['step'] for b in bs)}, in {bs[0]['phase']})"
            for host, bs in sorted(hosts.items())
        )
        return (
            f"{HUNG}: no heartbeat of run {self.run_key} moved for {still_s:.0f} s (runtime.hang_timeout_s="
            f"{self.timeout_s:g}): {nodes} froze with torchrun and every rank stopped (a paused VM, a stalled "
            "kernel), where no rank can report; the launcher ended the job; the stage's retry resumes from the "
            "newest checkpoint"
        )

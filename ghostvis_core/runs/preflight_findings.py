"""What a run's pre-flight found: a record of its own beside the run's launch spec, never written into it.

The launch spec is saved once by the side that plans the run; the job's rank 0 runs the pre-flight
(run/preflight.py) and saves what it learned here, `runs/<stage>/<run_key>/preflight.json`: the
per-source budget it measured from the token shards, or its refusal, with the process that found it.
The materialization reads the budget from here (its `source_budget` table).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ghostvis_core.store import Store

PREFLIGHT_FILE = "preflight.json"  # a run_file of the run's folder


@dataclass(frozen=True)
class SourceBudget:
    """Pre-flight, per source: tokens the budget needs vs tokens the tokenized shards hold."""

    needed_tokens: int
    available_tokens: int
    shards: int
    epochs: float


@dataclass(frozen=True)
class PreflightRecord:
    """One pre-flight's outcome: the budget per source when it passed, its message when it refused."""

    pid: int
    host: str
    source_budget: dict[str, SourceBudget] = field(default_factory=dict)
    refused: str | None = None

    def to_dict(self) -> dict:
        """{"pid", "host", "source_budget"} when it passed, {"pid", "host", "refused"} when it refused."""
        budget = {s: asdict(b) for s, b in self.source_budget.items()}
        found = {"refused": self.refused} if self.refused is not None else {"source_budget": budget}
        return {"pid": self.pid, "host": self.host, **found}

    @classmethod
    def from_dict(cls, data: dict) -> PreflightRecord:
        budget = {s: SourceBudget(**b) for s, b in data.get("source_budget", {}).items()}
        return cls(data["pid"], data["host"], budget, data.get("refused"))

    def save(self, store: Store, stage: str, run_key: str) -> None:
        """Atomically (the store's write: whole or not at all), by the rank that ran the pre-flight."""
        store.write_json("run_file", stage, run_key, PREFLIGHT_FILE, data=self.to_dict())


def preflight_record(store: Store, stage: str, run_key: str) -> PreflightRecord | None:
    """What the run's pre-flight left (None before it ran)."""
    if not store.exists("run_file", stage, run_key, PREFLIGHT_FILE):
        return None
    return PreflightRecord.from_dict(store.read_json("run_file", stage, run_key, PREFLIGHT_FILE))

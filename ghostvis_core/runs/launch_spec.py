"""LaunchSpec: everything one stage run needs, resolved before torchrun starts.

The spec is a JSON artifact in the store (kind run_spec), built whole by the launch side (launch.start_run)
and saved with the store's create-only write (`save`): nothing overwrites a saved record. A resume that launches
the run as saved writes nothing; one that launches it otherwise (another world size, node count, store URI) saves
a record of its own beside the first (kind run_spec_resume, spec.<n>.json), so each launch's record stays
readable; `LaunchSpec.read`, the one reader, returns the newest. Every rank reads it and nothing else (it does
not query the ledger or know who started it); what the job learns (the pre-flight's budget) is a record of its
own (runs/preflight_findings.py). It is frozen and typed (`from_dict(to_dict(spec)) == spec`): the resolved config, the
plan with its one BatchPlan, the shards as ShardRefs (their token files by store URI: a stream fetches one
when it opens it); `StageInputs` holds what the launcher worked out for this stage from its lineage.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from ghostvis_core.data.shard_ref import ShardRef
from ghostvis_core.errors import GhostvisError
from ghostvis_core.plan.budget import Plan
from ghostvis_core.plan.config import StageConfig

if TYPE_CHECKING:
    from ghostvis_core.store import Store

# source -> its selected shards, in the ledger's order
Shards = dict[str, tuple[ShardRef, ...]]


@dataclass(frozen=True)
class StageInputs:
    """What a stage takes from its lineage, beyond its config (all of it in the run's identity)."""

    # source -> token offset where the lineage stopped reading it (the stage continues there)
    stream_offsets: dict[str, int] = field(default_factory=dict)
    # context expansion: the upstream model's context and RoPE settings (for the before/after evidence)
    old_seq_len: int | None = None
    upstream_rope_base: float | None = None
    upstream_rope_scaling: float | None = None
    reasoning_source: str | None = None  # the source the reasoning evidence reads
    # rl: problem source -> its reward rule, from its manifest (data/problems.py); in the run identity, so
    # changing a source's rule makes the run stale
    reward_rules: dict[str, str] = field(default_factory=dict)
    new_vision: bool = False  # this stage introduces the vision stack (not in the upstream checkpoint)


@dataclass(frozen=True)
class LaunchSpec:
    stage: str
    run_key: str
    config: StageConfig  # the resolved config (presets.resolve)
    plan: Plan
    store: str  # the artifact store's URI (ghostvis_core.store.open_store)
    tokenizer_id: str
    train_shards: Shards
    val_shards: Shards
    mlflow_tracking_uri: str
    mlflow_experiment: str
    mlflow_artifact_location: str
    parent_run_key: str | None = None
    init_checkpoint: str | None = None
    tags: dict[str, str] = field(default_factory=dict)
    inputs: StageInputs = field(default_factory=StageInputs)

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "plan": self.plan.to_dict()}, indent=2, sort_keys=True)

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape the store holds (kind run_spec)."""
        return json.loads(self.to_json())

    def shard_versions(self) -> dict[str, str]:
        return shard_versions(self.train_shards, self.val_shards)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LaunchSpec:
        return cls(
            **{
                **data,
                "config": StageConfig.from_dict(data["config"]),
                "plan": Plan.from_dict(data["plan"]),
                "train_shards": shards_of(data["train_shards"]),
                "val_shards": shards_of(data["val_shards"]),
                "inputs": StageInputs(**data.get("inputs", {})),
            }
        )

    def save(self, store: Store) -> str | None:
        """Save this launch's record unless it equals the run's newest: at its first launch as spec.json, at a
        resume launched otherwise as the next spec.<n>.json. Each is created, never overwritten (the store's
        create-only write: a record another launch created first is read, not replaced). Returns its URI, or
        None when nothing was written."""
        data = self.to_dict()
        while True:
            records = launch_records(store, self.stage, self.run_key)
            if not store.exists(*records[0]):
                new = records[0]
            elif store.read_json(*records[-1]) == data:
                return None
            else:
                n = int(records[-1][-1]) + 1 if len(records) > 1 else 2
                new = ("run_spec_resume", self.stage, self.run_key, str(n))
            if store.create_json(*new, data=data):
                return store.uri_of(*new)

    @classmethod
    def read(cls, store: Store, stage: str, run_key: str) -> LaunchSpec:
        """A run's newest launch record (`saved_spec`). One saved by an older GhostVis (with fields this one no
        longer has, such as the pre-flight's `inputs.source_budget`, now in preflight.json) is refused by name."""
        newest = launch_records(store, stage, run_key)[-1]
        try:
            return cls.from_dict(store.read_json(*newest))
        except TypeError as exc:
            raise GhostvisError(
                f"run {run_key}: its launch record {store.uri_of(*newest)} has another shape "
                f"than this GhostVis writes ({exc}); it was saved by an older version: re-materialize {stage} "
                f"(or delete the run folder) to train it again"
            ) from None


def launch_records(store: Store, stage: str, run_key: str) -> list[tuple[str, ...]]:
    """The (kind, key) of a run's launch records, first to newest: spec.json (its first launch), then spec.<n>.json
    (n = 2, 3, ...: each resume launched otherwise than the newest record before it)."""
    later = sorted(int(key[-1]) for key in store.keys("run_spec_resume", stage, run_key) if key[-1].isdigit())
    return [("run_spec", stage, run_key), *(("run_spec_resume", stage, run_key, str(n)) for n in later)]


def saved_spec(store: Store, stage: str, run_key: str) -> dict[str, Any]:
    """A run's newest launch record as its JSON (what its job read last; readers of many runs, as the trace,
    take it untyped)."""
    return store.read_json(*launch_records(store, stage, run_key)[-1])


def shards_of(saved: dict[str, list[dict[str, Any]]]) -> Shards:
    """A saved spec's shard selection, typed."""
    return {source: tuple(ShardRef(**r) for r in refs) for source, refs in saved.items()}


def shard_versions(*selections: Shards) -> dict[str, str]:
    """shard_id -> the content sha256 of the version a run's launch spec selected (its train and validation
    shards, `selections`): the one version every reader of the run's shards goes through (token files,
    raw text, split), whatever versions of the shard arrived since."""
    return {r.shard_id: r.content_sha256 for refs in selections for rs in refs.values() for r in rs}


def saved_shard_versions(saved: dict[str, Any]) -> dict[str, str]:
    """`shard_versions` of a saved spec (its JSON, as the trace reads many without typing them whole)."""
    return shard_versions(shards_of(saved["train_shards"]), shards_of(saved["val_shards"]))

"""LaunchSpec: everything one stage run needs, resolved before torchrun starts.

The spec is a JSON artifact in the store (kind run_spec); every rank reads it and nothing else (it
does not query the ledger or know who started it). It carries the resolved config and the plan typed
(`from_dict(to_dict(spec)) == spec`); `StageInputs` holds what the launcher worked out for this stage from its
lineage; the trainer, the objectives and the evidence read typed fields.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from ghostvis_core.plan.budget import Plan
from ghostvis_core.plan.config import StageConfig
from ghostvis_core.store import Store


@dataclass
class SourceBudget:
    """Pre-flight, per source: tokens the budget needs vs tokens the tokenized shards hold."""

    needed_tokens: int
    available_tokens: int
    shards: int
    epochs: float


@dataclass
class StageInputs:
    """What a stage takes from its lineage and the pre-flight, beyond its config."""

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
    source_budget: dict[str, SourceBudget] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StageInputs:
        budget = {s: SourceBudget(**b) for s, b in data.get("source_budget", {}).items()}
        return cls(**{**data, "source_budget": budget})


@dataclass
class LaunchSpec:
    stage: str
    run_key: str
    config: StageConfig  # the resolved config (presets.resolve)
    plan: Plan
    store: str  # the artifact store's URI (ghostvis_core.store.open_store)
    tokenizer_id: str
    train_shards: dict[str, list[dict[str, Any]]]  # source -> ShardRef dicts
    val_shards: dict[str, list[dict[str, Any]]]
    mlflow_tracking_uri: str
    mlflow_experiment: str
    mlflow_artifact_location: str
    parent_run_key: str | None = None
    init_checkpoint: str | None = None
    tags: dict[str, str] = field(default_factory=dict)
    inputs: StageInputs = field(default_factory=StageInputs)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

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
                "inputs": StageInputs.from_dict(data.get("inputs", {})),
            }
        )


def shard_versions(*selections: dict[str, list[dict[str, Any]]]) -> dict[str, str]:
    """shard_id -> the content sha256 of the version a run's launch spec selected (its train and validation
    shards, `selections`): the one version every reader of the run's shards goes through (token files,
    raw text, split), whatever versions of the shard arrived since."""
    return {r["shard_id"]: r["content_sha256"] for refs in selections for rs in refs.values() for r in rs}


def localize_shards(spec: LaunchSpec, store: Store) -> None:
    """Point the spec's shards at this node's copies (fetched from the store by key when it is remote)."""
    for refs in (*spec.train_shards.values(), *spec.val_shards.values()):
        for ref in refs:
            ref["path"] = str(store.fetch("token_shard", spec.tokenizer_id, ref["shard_id"], ref["content_sha256"]))

"""ShardInput: one shard a run read, as the MLflow run's dataset input will describe it. A plain
record, so the training thread builds it without importing mlflow (mlflow_inputs turns it into
MLflow's entities on the logging thread)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShardInput:
    shard_id: str
    source: str
    split: str  # `train` or `validation`: the input's context
    content_sha256: str  # the ledger's hash of the raw shard
    uri: str  # the raw shard in the store (its sha256 is content_sha256)
    token_file: str  # what the run read: the shard tokenized with the run's tokenizer

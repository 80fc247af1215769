"""Where GhostVis keeps its state: one folder, GHOSTVIS_HOME (default ./.ghostvis).

Everything else (artifact store, Dagster instance, MLflow store) is derived from it unless the
user's own environment variable (DAGSTER_HOME, MLFLOW_TRACKING_URI) says otherwise.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Home:
    root: Path

    @classmethod
    def from_env(cls) -> "Home":
        return cls(Path(os.environ.get("GHOSTVIS_HOME", ".ghostvis")).expanduser().resolve())

    # --- artifact store (see DESIGN.md, "Artifact store") ---
    @property
    def store(self) -> Path:
        return self.root / "store"

    @property
    def sources(self) -> Path:
        """Where locally built sources (the embedded demo data) are published, as if remote."""
        return self.root / "sources"

    def raw_shard(self, shard_id: str) -> Path:
        return self.store / "shards" / "raw" / f"{shard_id}.parquet"

    def tokenizer_dir(self, tokenizer_id: str) -> Path:
        return self.store / "tokenizers" / tokenizer_id

    def token_shard(self, tokenizer_id: str, shard_id: str) -> Path:
        return self.store / "shards" / "tokens" / tokenizer_id / f"{shard_id}.arrow"

    @property
    def ledger(self) -> Path:
        return self.store / "ledger"

    def checkpoints(self, stage: str, run_key: str) -> Path:
        return self.store / "checkpoints" / stage / run_key

    def run_dir(self, stage: str, run_key: str) -> Path:
        """Launch specs and logs of one stage run (not artifacts: those live in the store)."""
        return self.root / "runs" / stage / run_key

    # --- services ---
    @property
    def dagster_home(self) -> Path:
        return Path(os.environ.get("DAGSTER_HOME") or self.root / "dagster").resolve()

    @property
    def mlflow_tracking_uri(self) -> str:
        return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{self.root / 'mlflow.db'}"

    @property
    def mlflow_artifacts(self) -> Path:
        return self.root / "mlartifacts"

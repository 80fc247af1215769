"""Where GhostVis keeps its state: one folder, GHOSTVIS_HOME (default ./.ghostvis).

The artifact store (ghostvis_core/store/), the Dagster instance and the MLflow store are derived
from it unless the user's own environment variable (DAGSTER_HOME, MLFLOW_TRACKING_URI) says otherwise.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ghostvis_core.store import Store, open_store


@dataclass(frozen=True)
class Home:
    root: Path

    @classmethod
    def from_env(cls) -> Home:
        return cls(Path(os.environ.get("GHOSTVIS_HOME", ".ghostvis")).expanduser().resolve())

    @property
    def store(self) -> Store:
        """GHOSTVIS_STORE (a folder, or s3://bucket/prefix) when set, else GHOSTVIS_HOME/store: the process's
        one object for that store (open_store), not a new one (and a new S3 client) per access."""
        return open_store(os.environ.get("GHOSTVIS_STORE") or str(self.root / "store"))

    @property
    def sources(self) -> Path:
        """Where locally built sources (the embedded demo data) are published, as if remote."""
        return self.root / "sources"

    @property
    def dagster_home(self) -> Path:
        return Path(os.environ.get("DAGSTER_HOME") or self.root / "dagster").resolve()

    @property
    def mlflow_tracking_uri(self) -> str:
        return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{self.root / 'mlflow.db'}"

    @property
    def mlflow_artifacts(self) -> Path:
        return self.root / "mlartifacts"

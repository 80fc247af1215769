"""Resources: where state lives (GhostvisHome). How a stage's job is launched: ghostvis_pipeline/launchers/."""

from __future__ import annotations

from pathlib import Path

from dagster import ConfigurableResource

from ghostvis_core.home import Home


class GhostvisHome(ConfigurableResource):
    """GHOSTVIS_HOME: artifact store, MLflow store. Empty = the environment's value (read at run time)."""

    root: str = ""

    def home(self) -> Home:
        return Home(Path(self.root).resolve()) if self.root else Home.from_env()

"""The folders a Dagster command needs before it runs: GHOSTVIS_HOME and the Dagster instance folder
(DAGSTER_HOME if set, else $GHOSTVIS_HOME/dagster) holding the project's dagster.yaml.

`ghostvis init` prepares them for a user who runs `dagster ...` directly; `ghostvis demo` and
`ghostvis train` prepare them for their in-process runs. Preparing twice changes nothing.
"""

from __future__ import annotations

import os
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

from ghostvis_core.home import Home

PROJECT_DAGSTER_YAML = Path(__file__).resolve().parent.parent / "dagster.yaml"
NEXT_COMMAND = "dagster asset materialize --select shard_manifest -m ghostvis_pipeline.definitions"


@dataclass(frozen=True)
class Prepared:
    home: Path
    dagster_home: Path
    dagster_yaml: str  # "copied", "kept" (the folder already had one) or "missing" (no project file)


def prepare_environment(home: Home) -> Prepared:
    """Create GHOSTVIS_HOME and the Dagster instance folder, copy the project's dagster.yaml there
    unless the folder already has one, and point this process's Dagster at it."""
    os.environ.setdefault("GHOSTVIS_HOME", str(home.root))
    dagster_home = home.dagster_home
    os.environ["DAGSTER_HOME"] = str(dagster_home)
    home.root.mkdir(parents=True, exist_ok=True)
    dagster_home.mkdir(parents=True, exist_ok=True)
    target = dagster_home / "dagster.yaml"
    if target.exists():
        state = "kept"
    elif PROJECT_DAGSTER_YAML.exists():
        shutil.copyfile(PROJECT_DAGSTER_YAML, target)
        state = "copied"
    else:
        state = "missing"
    return Prepared(home.root, dagster_home, state)


def init_report(p: Prepared) -> str:
    """What `ghostvis init` prints: what it made, the two exports, the next command."""
    yaml = {"copied": f"copied {PROJECT_DAGSTER_YAML}",
            "kept": "kept the existing one",
            "missing": f"none ({PROJECT_DAGSTER_YAML} not found: Dagster's defaults apply)"}[p.dagster_yaml]
    return "\n".join([
        f"GHOSTVIS_HOME: {p.home}",
        f"DAGSTER_HOME:  {p.dagster_home}  (dagster.yaml: {yaml})",
        "",
        "Set these in your shell (the project's venv active), then materialize the first asset:",
        f"  export GHOSTVIS_HOME={shlex.quote(str(p.home))}",
        f"  export DAGSTER_HOME={shlex.quote(str(p.dagster_home))}",
        f"  {NEXT_COMMAND}",
    ])

"""The folders a Dagster command needs before it runs: GHOSTVIS_HOME and the Dagster instance folder
(DAGSTER_HOME if set, else $GHOSTVIS_HOME/dagster) holding the project's dagster.yaml.

`ghostvis init` prepares them for a user who runs `dagster ...` directly (`--dagster-config` installs
another instance config, e.g. deploy/dagster-postgres.yaml for a team); `ghostvis demo` and
`ghostvis train` prepare them for their in-process runs. Preparing twice changes nothing.
"""

from __future__ import annotations

import os
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

import yaml

from ghostvis_core.errors import GhostvisError
from ghostvis_core.home import Home

PROJECT_DAGSTER_YAML = Path(__file__).resolve().parent.parent / "dagster.yaml"
NEXT_COMMAND = "dagster asset materialize --select shard_manifest -m ghostvis_pipeline.definitions"


@dataclass(frozen=True)
class Prepared:
    home: Path
    dagster_home: Path
    dagster_yaml: str  # "copied", "kept" (the folder already had one) or "missing" (no project file)
    source: Path  # the instance config copied (or that would have been)


def prepare_environment(home: Home, dagster_config: Path | None = None) -> Prepared:
    """Create GHOSTVIS_HOME and the Dagster instance folder, copy the instance config there (the
    project's dagster.yaml unless `dagster_config` names another) unless the folder already has one,
    and point this process's Dagster at it. A config asked for by name never silently loses to a
    different one already in the folder: that would leave the runs in the other storage."""
    source = (dagster_config or PROJECT_DAGSTER_YAML).resolve()
    if dagster_config is not None and not source.is_file():
        raise GhostvisError(
            f"Dagster instance config {dagster_config} not found; pass an existing file, "
            f"e.g. --dagster-config deploy/dagster-postgres.yaml"
        )
    os.environ.setdefault("GHOSTVIS_HOME", str(home.root))
    dagster_home = home.dagster_home
    os.environ["DAGSTER_HOME"] = str(dagster_home)
    home.root.mkdir(parents=True, exist_ok=True)
    dagster_home.mkdir(parents=True, exist_ok=True)
    target = dagster_home / "dagster.yaml"
    if target.exists():
        if dagster_config is not None and target.read_bytes() != source.read_bytes():
            raise GhostvisError(
                f"{target} exists and differs from {dagster_config}; move it away (its runs stay "
                f"in the storage it names) and run `ghostvis init --dagster-config {dagster_config}` again"
            )
        state = "kept"
    elif source.exists():
        shutil.copyfile(source, target)
        state = "copied"
    else:
        state = "missing"
    return Prepared(home.root, dagster_home, state, source)


def env_vars_read(config: Path) -> list[str]:
    """The environment variables an instance config reads (`{env: NAME}` values), in file order, so
    `ghostvis init` can tell the user to export them (the Postgres config's connection)."""

    def walk(node) -> list[str]:
        if isinstance(node, dict):
            if set(node) == {"env"}:
                return [node["env"]]
            return [name for value in node.values() for name in walk(value)]
        return [name for value in node for name in walk(value)] if isinstance(node, list) else []

    return walk(yaml.safe_load(config.read_text()) or {}) if config.is_file() else []


def init_report(p: Prepared) -> str:
    """What `ghostvis init` prints: what it made, the two exports, the next command."""
    state = {
        "copied": f"copied {p.source}",
        "kept": "kept the existing one",
        "missing": f"none ({p.source} not found: Dagster's defaults apply)",
    }[p.dagster_yaml]
    needed = env_vars_read(p.dagster_home / "dagster.yaml")
    return "\n".join(
        [
            f"GHOSTVIS_HOME: {p.home}",
            f"DAGSTER_HOME:  {p.dagster_home}  (dagster.yaml: {state})",
            "",
            "Set these in your shell (the project's venv active), then materialize the first asset:",
            f"  export GHOSTVIS_HOME={shlex.quote(str(p.home))}",
            f"  export DAGSTER_HOME={shlex.quote(str(p.dagster_home))}",
            *([f"  export {' '.join(f'{name}=...' for name in needed)}   # read by dagster.yaml"] if needed else []),
            f"  {NEXT_COMMAND}",
        ]
    )

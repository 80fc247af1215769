"""Shared fixtures for the end-to-end tests: one smoke-preset demo, built once per session through
the real `ghostvis` CLI, that later tests read (and copy when they need to break something)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


def cli_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DAGSTER_", "MLFLOW_", "GHOSTVIS_"))}
    env.update(GHOSTVIS_HOME=str(home), DAGSTER_HOME=str(home / "dagster"), GHOSTVIS_PRESET="smoke",
               PYTHONUNBUFFERED="1", **extra)
    return env


def run_cli(args: list[str], home: Path, timeout: float = 600, check: bool = True, **extra: str):
    """Run a console script of this venv (ghostvis, dagster, torchrun, mlflow) against `home`."""
    exe = str(BIN / args[0]) if (BIN / args[0]).exists() else args[0]
    proc = subprocess.run([exe, *args[1:]], env=cli_env(home, **extra), capture_output=True, text=True,
                          timeout=timeout, cwd=Path(__file__).resolve().parent.parent)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


@pytest.fixture(scope="session")
def demo_home(tmp_path_factory) -> Path:
    """A GHOSTVIS_HOME after `ghostvis demo --preset smoke` (every asset, every stage)."""
    home = tmp_path_factory.mktemp("ghostvis") / "home"
    proc = run_cli(["ghostvis", "demo", "--preset", "smoke"], home, timeout=1200)
    (home / "demo_stdout.txt").write_text(proc.stdout)
    return home


@pytest.fixture
def home_copy(demo_home, tmp_path) -> Path:
    """A private copy of the demo home, for tests that break or extend it."""
    dest = tmp_path / "home"
    shutil.copytree(demo_home, dest, symlinks=True)
    return dest

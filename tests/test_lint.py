"""The code is formatted and linted as pyproject.toml's [tool.ruff] says, so a drift fails here and not in
review: `ruff format` (line length 120) and `ruff check` (pycodestyle, pyflakes, import order, bugbear,
pyupgrade) over the whole repository."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.conftest import BIN

ROOT = Path(__file__).resolve().parent.parent


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "ruff"), *args], cwd=ROOT, capture_output=True, text=True)


def test_the_repository_is_formatted():
    done = ruff("format", "--check", ".")
    assert done.returncode == 0, f"run `.venv/bin/ruff format .`:\n{done.stdout}{done.stderr}"


def test_the_repository_passes_the_linter():
    done = ruff("check", "--output-format", "concise", ".")
    assert done.returncode == 0, f"fix these (`.venv/bin/ruff check --fix .` fixes some):\n{done.stdout}{done.stderr}"


def test_the_linter_reports_a_planted_problem(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("import os\n\n\ndef f(l):\n    return l\n")
    done = ruff("check", "--config", "pyproject.toml", "--output-format", "concise", "--no-cache", str(planted))
    assert done.returncode == 1
    assert "F401" in done.stdout and "E741" in done.stdout

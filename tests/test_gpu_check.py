"""benchmarks/gpu_check.py on CPU: what it imports exists on the GPU machine (PyTorch, numpy and the
working tree, not MLflow, Dagster, datatrove or torchao), its carried-wheel folder is checked, and
without a CUDA device it says so."""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

import gpu_check  # noqa: E402

# installed in this venv, absent on the GPU machine (torchao travels as a wheel, unpacked at run time)
ABSENT_ON_GPU = ("mlflow", "dagster", "dagster_pipes", "datatrove", "duckdb", "boto3", "lm_eval", "psutil", "torchao")
BLOCKER = """
import importlib.abc, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {absent!r}:
            raise ImportError("not on the GPU machine: " + name)
sys.meta_path.insert(0, Absent())
"""


def import_statements(path: Path) -> set[str]:
    """Every import statement of a file, at its top or inside a function, as source."""
    tree = ast.parse(path.read_text())
    return {
        ast.unparse(n)
        for n in ast.walk(tree)
        if isinstance(n, ast.Import | ast.ImportFrom)
        and not getattr(n, "level", 0)
        and getattr(n, "module", "") != "__future__"
    }


def test_everything_the_check_imports_exists_without_the_packages_the_gpu_machine_lacks():
    statements = sorted(import_statements(BENCH / "gpu_check.py") | import_statements(BENCH / "gpu_throughput.py"))
    assert {"from ghostvis_core.run.model import gpt", "import gpu_throughput"} <= set(statements)
    code = BLOCKER.format(absent=set(ABSENT_ON_GPU)) + "\n".join(statements)
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=BENCH,
        env={"PYTHONPATH": f"{ROOT}:{BENCH}", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_wheel_folder_must_hold_torchao_as_a_wheel_under_the_carry_limit(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "WHEELS", tmp_path)
    monkeypatch.setattr(gpu_check, "ROOT", tmp_path.parent)
    problems = gpu_check.check_wheels()
    assert len(problems) == 1 and "no torchao wheel" in problems[0] and "--prepare" in problems[0]
    wheel = tmp_path / "torchao-0.18.0-cp310-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("torchao/__init__.py", "")
    assert gpu_check.check_wheels() == []
    assert f"{tmp_path.name}, 1 files, 0.0 MiB" in capsys.readouterr().out
    (tmp_path / "broken-1.0-py3-none-any.whl").write_text("not a zip")
    monkeypatch.setattr(gpu_check, "CARRY_LIMIT_BYTES", 10)
    problems = gpu_check.check_wheels()
    assert len(problems) == 2 and "MiB a call carries" in problems[0] and "is not a wheel" in problems[1]


@pytest.mark.skipif(gpu_check.torch.cuda.is_available(), reason="measures on a GPU; the CPU path is what is tested")
def test_without_cuda_it_says_so_and_exits_0_once_the_wheels_are_there(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "WHEELS", tmp_path)
    monkeypatch.setattr(gpu_check, "ROOT", tmp_path.parent)
    monkeypatch.setattr(sys, "argv", ["gpu_check.py"])
    assert gpu_check.main() == 1  # the folder lacks torchao: a GPU call would measure no float8
    with zipfile.ZipFile(tmp_path / "torchao-0.18.0-cp310-abi3-manylinux_2_28_x86_64.whl", "w") as z:
        z.writestr("torchao/__init__.py", "")
    assert gpu_check.main() == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("no CUDA device")

"""benchmarks/gpu_check.py on CPU: what its own process imports exists on the GPU machine (PyTorch,
numpy and the working tree, not MLflow, Dagster, datatrove or torchao), what its trainer part imports
is there or carried, its carried folder is checked, and without a CUDA device it says so. (The trainer
part itself runs in an isolated venv in benchmarks/gpu_check_isolated.py: minutes, not a test.)"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

import gpu_check  # noqa: E402
import gpu_check_isolated  # noqa: E402
import gpu_trainer  # noqa: E402

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


def carried_folder(folder: Path, pins: list[str], wheels: list[str] | None = None) -> None:
    """A carried folder as --prepare leaves it: carried.json and the archive `pack` makes of a wheel per
    name of `wheels` (default: per pin) and the data-only home."""
    (folder / "carried.json").write_text(json.dumps({"python": "3.12", "pins": pins}))
    for pin in pins if wheels is None else wheels:
        name, version = pin.split("==")
        with zipfile.ZipFile(folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl", "w") as z:
            z.writestr(f"{name.replace('-', '_')}/__init__.py", "x = 1\n" * 1000, compress_type=zipfile.ZIP_DEFLATED)
    (folder / "home" / "store").mkdir(parents=True)
    gpu_check.pack(folder)


def test_the_carried_archive_must_hold_a_wheel_per_pin_and_the_home_under_the_carry_limit(
    tmp_path, monkeypatch, capsys
):
    carried, unpacked = tmp_path / "carried", tmp_path / "unpacked"
    carried.mkdir()
    monkeypatch.setattr(gpu_check, "WHEELS", carried)
    monkeypatch.setattr(gpu_check, "ROOT", tmp_path)
    problems = gpu_check.carried_problems(unpacked)
    assert len(problems) == 2 and "no " + str(carried / "carried.json") in problems[0] and "--prepare" in problems[0]
    assert "no " + str(carried / "carried.tar.xz") in problems[1]
    carried_folder(carried, ["torchao==0.18.0", "mlflow-skinny==3.17.2"])
    assert sorted(p.name for p in carried.iterdir()) == ["carried.json", "carried.tar.xz"]  # packed: nothing loose
    assert gpu_check.carried_problems(unpacked / "1") == []
    out = capsys.readouterr().out
    assert "carried folder: carried, 0.0 MiB in all" in out and "mlflow_skinny-3.17.2-py3-none-any.whl" in out
    with zipfile.ZipFile(unpacked / "1" / "torchao-0.18.0-py3-none-any.whl") as z:  # a wheel still, stored
        assert [i.compress_type for i in z.infolist()] == [zipfile.ZIP_STORED]
        assert z.read("torchao/__init__.py") == b"x = 1\n" * 1000
    (carried / "carried.tar.xz").unlink()
    carried_folder(carried, ["torchao==0.18.0", "mlflow-skinny==3.17.2"], wheels=["torchao==0.18.0"])
    monkeypatch.setattr(gpu_check, "CARRY_LIMIT_BYTES", 10)
    problems = gpu_check.carried_problems(unpacked / "2")
    assert len(problems) == 2 and "MiB allowed" in problems[0]
    assert "no wheel of mlflow-skinny==3.17.2 in " + str(carried / "carried.tar.xz") in problems[1]


@pytest.mark.skipif(gpu_check.torch.cuda.is_available(), reason="measures on a GPU; the CPU path is what is tested")
def test_a_fresh_clone_is_told_what_to_run_first_and_without_cuda_it_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "ROOT", tmp_path.parent)
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--wheels", str(tmp_path)])
    assert gpu_check.main() == 1  # no carried.json: a GPU call would run neither float8 nor the trainer
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "first run: make gpu-check (or: .venv/bin/python benchmarks/gpu_check.py --prepare), " + (
        "where PyPI is reachable"
    )
    carried_folder(tmp_path, ["torchao==0.18.0"])
    assert gpu_check.main() == 0  # prepared, on a machine without a GPU: nothing to check here
    assert capsys.readouterr().out.splitlines()[-1].startswith("no CUDA device: nothing to measure here")


def test_what_travels_is_what_the_trainer_float8_and_the_audit_need_beyond_the_gpu_machine():
    there = gpu_trainer.gpu_machine_here()
    assert {"torch", "numpy", "transformers", "requests", "pyyaml", "tokenizers", "packaging"} <= set(there)
    carried = gpu_trainer.carried(gpu_check.CARRIED_ROOTS)
    for name in ("mlflow-skinny", "pydantic", "sqlalchemy", "alembic", "duckdb", "dagster-pipes", "torchao"):
        assert carried[name] == importlib.metadata.version(name)
    assert not set(carried) & set(there)
    assert {"mlflow", "dagster", "datatrove", "boto3", "lm-eval"}.isdisjoint(carried)  # the server, the pipeline


# What a training rank and the audit import, at start and later (tracking, system metrics, datasets,
# the model registry, the ledger's queries): with every distribution but the GPU machine's and the
# carried ones blocked. benchmarks/gpu_check_isolated.py runs the trainer itself in such an environment.
TRAINER_IMPORTS = """
import ghostvis_core.run.__main__, ghostvis_core.launch.start, ghostvis_core.run.train.loop
import ghostvis_core.run.hf.register, ghostvis_core.run.track.mlflow_system, ghostvis_core.run.track.mlflow_inputs
import ghostvis_core.run.track.mlflow_models, ghostvis_core.run.track.pipes, ghostvis_core.verify.audit.audit_report
import mlflow.tracking, mlflow.transformers, mlflow.store.tracking.sqlalchemy_store, duckdb, torchao.float8
"""


def test_the_trainer_and_the_audit_import_nothing_but_the_gpu_machine_s_and_the_carried_distributions(tmp_path):
    """Without site-packages (-S): the working tree and links to the allowed distributions only."""
    allowed = gpu_trainer.gpu_machine_here() | gpu_trainer.carried(gpu_check.CARRIED_ROOTS)
    site = gpu_check_isolated.linked_site(tmp_path / "site", allowed)
    proc = subprocess.run(
        [sys.executable, "-S", "-c", TRAINER_IMPORTS + "import dagster"],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": f"{ROOT}:{site}"},
    )
    assert proc.stderr.strip().splitlines()[-1] == "ModuleNotFoundError: No module named 'dagster'", proc.stderr[-3000:]


def test_the_table_gives_the_trainer_part_s_verdicts_alone_or_after_the_gpu_parts():
    trainer = {
        "steps": 10,
        "val_loss_start": 8.371,
        "val_loss": 7.341,
        "loss_fell": True,
        "ledger_equals_trainer": True,
        "audit_failures": [],
        "tokens_per_sec": 60.9,
        "wall_s": 289.1,
        "attention_kernel": "sdpa-per-document",
    }
    assert gpu_check.table({"trainer": trainer}) == [
        "trainer 10 steps      held-out loss 8.371 -> 7.341  ledger = trainer = MLflow = recount  audit passed  "
        "61 tok/s, 289 s launch to audit (sdpa-per-document)"
    ]
    failed = trainer | {"val_loss": 8.5, "loss_fell": False, "ledger_equals_trainer": False}
    failed["audit_failures"] = ["pretrain: no_reuse: rows 0-9 read twice"]
    line = gpu_check.table({"gpu": "H100", "peak_tflops": 800.0, "trainer": failed})[1]
    assert "8.371 -> 8.500 (did NOT fall)  figures DISAGREE  audit FAILED: pretrain: no_reuse: rows 0-9" in line
    assert gpu_check.table({"trainer": {"error": "trainer exited 2: error: no shard"}}) == [
        "trainer              failed: trainer exited 2: error: no shard"
    ]


def test_the_fsdp2_resume_part_resumes_a_committed_checkpoint_to_the_same_losses_on_cpu(monkeypatch):
    """The part that failed on the H200 for its own harness (a checkpoint saved without its COMPLETE
    marker, which loading rightly refused) runs here over gloo: the resumed model, started from other
    weights, takes the same two steps as the uninterrupted one."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("MASTER_PORT", str(s.getsockname()[1]))
    r = gpu_check.fsdp_resume(torch.device("cpu"), d_model=64, seq_len=64)  # the GPU's shape, small
    assert r["ok"] and r["max_rel_diff"] <= gpu_check.RESUME_TOLERANCE, r
    assert len(r["resumed"]) == 2 and r["resumed"][0] < 9.0  # a 4,096-token vocabulary starts near ln 4096 = 8.3


def fsdp_figures(monkeypatch) -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("MASTER_PORT", str(s.getsockname()[1]))
    return gpu_check.fsdp_resume(torch.device("cpu"), d_model=64, seq_len=64)


def test_a_part_that_misses_its_goal_or_fails_makes_the_check_exit_1_naming_it(tmp_path, monkeypatch, capsys):
    """The FSDP2 resume part measured here on CPU, with the trainer-versus-bare figures of a run: every goal
    met exits 0; the resume's tolerance set out of reach (the same figures), or a part that errored, exits 1
    and the last table and line name the part."""
    out = tmp_path / "gpu_check.json"
    vs_bare = {"trainer_tokens_per_sec": 97_000.0, "bare_tokens_per_sec": 100_000.0, "ratio": 0.97, "steps": 30}
    results = {"fsdp_resume": fsdp_figures(monkeypatch), "trainer_vs_bare": vs_bare}
    assert gpu_check.report(out, results) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "gpu check: every goal met"
    assert lines[-3].split()[0] == "fsdp_resume" and lines[-3].endswith("pass")
    assert "0.970 (97,000 / 100,000 tok/s)" in lines[-2] and lines[-2].endswith("pass")

    monkeypatch.setattr(gpu_check, "RESUME_TOLERANCE", -1.0)  # out of reach: below any difference
    assert gpu_check.report(out, results) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "gpu check: FAILED: fsdp_resume" and lines[-3].endswith("FAIL")
    assert json.loads(out.read_text())["fsdp_resume"]["max_rel_diff"] == results["fsdp_resume"]["max_rel_diff"]

    monkeypatch.setattr(gpu_check, "GOAL_TRAINER_RATIO", 0.98)
    results["trainer"] = {"error": "trainer exited 2: error: no shard"}
    assert gpu_check.report(out, results) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "gpu check: FAILED: fsdp_resume, trainer, trainer_vs_bare"
    assert "trainer exited 2: error: no shard" in lines[-3] and lines[-3].endswith("ERROR")


def test_the_versions_part_fails_on_a_torch_other_than_the_pin(monkeypatch):
    pin = gpu_check.torch_pin()
    assert re.fullmatch(r"\d+\.\d+\.\d+", pin)  # read from scripts/install-torch
    ran = {"torch": pin + "+cu130", "torch_pin": pin, "cuda": "13.0", "driver": "580.65.06"}
    assert gpu_check.verdicts({"versions": ran})[0][2:] == (f"torch {pin}+cu130, CUDA 13.0, driver 580.65.06", "pass")
    assert gpu_check.verdicts({"versions": ran | {"torch": "2.9.1+cu128"}})[0][3] == "FAIL"
    assert gpu_check.report(Path(os.devnull), {}) == 1  # nothing measured is not a pass

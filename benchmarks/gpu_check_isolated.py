"""gpu_check's trainer part on CPU, in an environment that holds only what the GPU machine holds.

A fresh venv (no system site-packages, no GhostVis installed) sees, through a .pth file, a folder of
links to this venv's copies of the GPU machine's distributions and their requirements
(gpu_trainer.GPU_MACHINE) and nothing else; `gpu_check.py --prepare` fills a carried folder
for this Python; then the venv's Python runs `gpu_check.py --trainer-on-cpu` from the working tree,
which installs the carried wheels into a temporary folder and runs the real trainer and the audit.
If the trainer or the audit imported anything the carried folder lacks, the run fails here, not on
the GPU. Goal: the trainer part passes (loss falls, ledger = trainer, audit passes). Takes minutes
(the preparation builds a demo data home; the CPU trains), so it is a benchmark, not a test.

    .venv/bin/python benchmarks/gpu_check_isolated.py [--preset smoke] [--steps 10] [--keep]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_trainer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
NOT_THERE = ("mlflow", "duckdb", "sqlalchemy", "dagster", "datatrove", "torchao", "psutil", "ghostvis_core")


def linked_site(dest: Path, names) -> Path:
    """Links in `dest` to every top-level file or folder of these installed distributions (their RECORDs)."""
    dest.mkdir(parents=True)
    for name in names:
        dist = importlib.metadata.distribution(name)
        for top in {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            source = Path(dist.locate_file(top))
            if source.exists() and not (dest / top).exists() and not top.endswith(".pth"):
                (dest / top).symlink_to(source)
    return dest


def run(cmd: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    print("$", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT, env=env, text=True, capture_output=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="smoke", help="the trainer part's preset (default smoke: a shared CPU)")
    ap.add_argument("--steps", type=int, default=10, help="the trainer part's steps")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gpu_check_isolated-"))
    try:
        venv = tmp / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        gpu_machine = gpu_trainer.gpu_machine_here()
        linked_site(tmp / "gpu_machine_site", gpu_machine)
        site = next(venv.glob("lib/python*/site-packages"))
        (site / "gpu_machine.pth").write_text(str(tmp / "gpu_machine_site") + "\n")
        python = str(venv / "bin" / "python")
        env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", str(tmp)), "PYTHONUNBUFFERED": "1"}
        probe = f"import importlib.util as u; print([m for m in {NOT_THERE!r} if u.find_spec(m)])"
        absent = subprocess.run([python, "-c", probe], cwd=tmp, env=env, text=True, capture_output=True, check=True)
        print(f"isolated venv: {len(gpu_machine)} distributions; importable of {NOT_THERE}: {absent.stdout}")
        if absent.stdout.strip() != "[]":
            return 1
        wheels = tmp / "wheels"
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        start = time.perf_counter()
        prep = run(
            [sys.executable, "benchmarks/gpu_check.py", "--prepare", "--wheels", str(wheels)]
            + ["--python-version", version]
        )
        print(prep.stdout[-1500:], prep.stderr[-1500:] if prep.returncode else "", flush=True)
        if prep.returncode != 0:
            return 1
        print(f"prepared in {time.perf_counter() - start:.0f} s", flush=True)
        out = tmp / "out.json"
        start = time.perf_counter()
        check = run(
            [python, "benchmarks/gpu_check.py", "--wheels", str(wheels), "--trainer-on-cpu", "--out", str(out)]
            + ["--trainer-preset", args.preset, "--trainer-steps", str(args.steps)],
            env=env,
        )
        print(check.stdout[-3000:], check.stderr[-3000:], flush=True)
        wall = time.perf_counter() - start
        trainer = json.loads(out.read_text())["trainer"] if out.exists() else {"error": "no figures"}
        ok = check.returncode == 0 and trainer.get("ok", False)
        print(f"trainer part in the isolated venv: {'passed' if ok else 'FAILED'} in {wall:.0f} s")
        print(json.dumps({k: v for k, v in trainer.items() if k != "log_tail"}, indent=1, default=str))
        return 0 if ok else 1
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

"""The GPU check's trainer part: the real trainer on the demo corpus, then the audit of what it trained.

`ghostvis prepare pretrain`, then its `-m ghostvis_core.run --spec` line under torchrun (one rank), for 30 steps of
the tiny preset in a scratch copy of a data-only demo home (raw shards, tokenizer, token files, ledger: built here by
`--prepare` with the demo's own assets, since tokenizing needs datatrove and Dagster), MLflow in the
home's SQLite file (the default: MLflow 3.17 refuses its filesystem backend unless
MLFLOW_ALLOW_FILE_STORE is set), then `ghostvis audit --stage pretrain`'s function on that home:
the held-out loss falls, every figure of the trainer's run record equals the ledger's, MLflow's and
the recount from the token files, and every check passes.

The GPU machine holds only GPU_MACHINE; what the trainer and the audit import
beyond that is TRAINER_NEEDS and its requirements, carried as wheels (`carried`).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Every distribution the GPU machine holds, as listed for its image (read there on 2026-11-17). Not the
# closure of a few roots in this venv: this venv's transformers requires pydantic, the GPU machine's does
# not, and an MLflow carried without pydantic failed to import there (2026-11-28).
GPU_MACHINE = tuple(
    """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
    certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
    cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
    flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
    huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt
    jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
    linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
    mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
    numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
    nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
    nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx
    onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
    orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
    propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
    pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
    pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
    scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
    sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
    tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
    torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop
    wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp""".split()
)
# What the trainer and the audit import that the GPU machine lacks: the MLflow client and its SQLite
# store (the run's params, metrics, datasets and the model registry), the ledger's queries (duckdb),
# the system metrics (psutil) and the Dagster Pipes messages (imported by the tracker, used only under Pipes).
TRAINER_NEEDS = ("mlflow-skinny", "sqlalchemy", "alembic", "duckdb", "psutil", "dagster-pipes")
PRESET = "tiny"
STEPS = 30
STAGE = "pretrain"


def closure(roots: tuple[str, ...]) -> dict[str, str]:
    """Every distribution installed here that `roots` need (their requirements, recursively, without
    extras), as {normalized name: version}; a root not installed here is left out."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found: dict[str, str] = {}
    todo = [canonicalize_name(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        found[name] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(req.name))
    return found


def carried(roots: tuple[str, ...] = TRAINER_NEEDS) -> dict[str, str]:
    """What must travel as wheels for `roots`: their closure less the GPU machine's, at this venv's versions."""
    return {name: v for name, v in closure(roots).items() if name not in GPU_MACHINE}


def gpu_machine_here() -> dict[str, str]:
    """The GPU machine's distributions that this venv holds too, as {name: version} (what an environment
    imitating the GPU machine links to)."""
    found = {}
    for name in GPU_MACHINE:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def prepare_home(dest: Path, preset: str = PRESET) -> None:
    """A data-only demo home at `dest` (its store: raw shards, tokenizer, token files, ledger), built by
    the demo's assets here (`shard_manifest`, then `ghostvis data`), without Dagster's or MLflow's state."""
    bin_dir = Path(sys.executable).parent
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DAGSTER_", "MLFLOW_", "GHOSTVIS_"))}
        env |= {"GHOSTVIS_HOME": tmp, "DAGSTER_HOME": f"{tmp}/dagster"}
        root = Path(__file__).resolve().parent.parent
        for cmd in (
            [bin_dir / "ghostvis", "init"],
            [bin_dir / "dagster", "asset", "materialize", "-m", "ghostvis_pipeline.definitions"]
            + ["--select", "shard_manifest"],
            [bin_dir / "ghostvis", "data", "--preset", preset],
        ):
            proc = subprocess.run([str(c) for c in cmd], env=env, cwd=root, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(map(str, cmd))} exited {proc.returncode}: {proc.stderr[-2000:]}")
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(Path(tmp) / "store", dest / "store", ignore=shutil.ignore_patterns("leases"))


def run_trainer(home_src: Path, log: Path, preset: str = PRESET, steps: int = STEPS) -> dict:
    """The trainer's run in a scratch copy of `home_src` and the audit of it: figures and verdicts; the
    trainer's whole output is kept in `log` (a failure's cause is rarely in its last line)."""
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp) / "home"
        shutil.copytree(home_src, home)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DAGSTER_", "MLFLOW_", "GHOSTVIS_"))}
        env |= {"GHOSTVIS_HOME": str(home), "PYTHONUNBUFFERED": "1"}
        # evaluation and checkpoints at the end only: its tokens/s is the steps' own (the trainer_vs_bare part)
        sets = [
            f"budget.steps={steps}",
            "batch.world_size=1",
            "eval.every_steps=1000000",
            "checkpoint.every_steps=1000000",
        ]
        prepare = [sys.executable, "-m", "ghostvis_pipeline.cli", "prepare", STAGE, "--preset", preset]
        planned = subprocess.run(
            [*prepare, *(a for s in sets for a in ("--set", s))], env=env, capture_output=True, text=True
        )
        if planned.returncode != 0:
            return {"error": f"ghostvis prepare exited {planned.returncode}: {last_error(planned.stderr)}"}
        torchrun_line = shlex.split(planned.stdout.strip().splitlines()[-1])
        cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun_line[1:]]
        start = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        log.write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            return {"error": f"trainer exited {proc.returncode}: {last_error(proc.stdout + proc.stderr)}"}
        return {"wall_s": round(wall, 1), **audited(home), "log_tail": proc.stdout[-1500:]}


def last_error(log: str) -> str:
    """The trainer's own `error:` line, else the last Python exception's line (torchrun's failure banner
    that follows it names no cause), else the log's last line."""
    errors = re.findall(r"^error: .*$", log, flags=re.M) or re.findall(r"^\w+(?:Error|Exception): .*$", log, flags=re.M)
    return errors[-1] if errors else (log.strip().splitlines() or [""])[-1]


def audited(home: Path) -> dict:
    """`ghostvis audit --stage pretrain` on the trained home, and the run record's loss and speed."""
    from ghostvis_core.home import Home
    from ghostvis_core.runs.lookup import newest_completed_run
    from ghostvis_core.verify.audit.audit_report import audit

    os.environ.pop("MLFLOW_TRACKING_URI", None)  # the home's own SQLite file, as the trainer used
    report = audit(Home(home), [STAGE], {}, required=True)
    record = newest_completed_run(Home(home).store, STAGE)
    rows = report["stages"][0]["figures"] if report["stages"] else []
    loss_fell = record.val_loss_start is not None and record.val_loss < record.val_loss_start
    ledger_equals_trainer = bool(rows) and all(r[-1] == "ok" for r in rows)
    return {
        "run_key": record.run_key,
        "config": json.loads(Path(Home(home).store.fetch("run_spec", STAGE, record.run_key)).read_text())["config"],
        "steps": record.steps,
        "tokens_per_sec": record.tokens_per_sec,
        "first_step_s": record.first_step_s,
        "attention_kernel": record.attention_kernel,
        "val_loss_start": record.val_loss_start,
        "val_loss": record.val_loss,
        "train_loss": record.train_loss,
        "loss_fell": loss_fell,
        # name -> [trainer, ledger, MLflow, Dagster metadata ("-": none here), recount, "ok" or "MISMATCH"]
        "figures": {r[0]: r[1:] for r in rows},
        "ledger_equals_trainer": ledger_equals_trainer,
        "audit_failures": report["failures"],
        "ok": loss_fell and ledger_equals_trainer and not report["failures"],
    }

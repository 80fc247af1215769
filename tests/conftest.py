"""Shared fixtures for the end-to-end tests: one smoke-preset demo, built once per session through
the real `ghostvis` CLI, that later tests read (and copy when they need to break something).

The suite runs on two pytest-xdist workers, a test file per worker at a time (`--dist loadfile`): the
demo home and the short reference pretrain are built once, by the first worker to need them, and shared
(`built_once`); `pytest_collection_modifyitems` orders the files so that the other worker runs the files
that need no demo while it is built."""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

BIN = Path(sys.executable).parent
# What every `mlflow server` the tests start adds to its environment: no job runner (its worker pool runs MLflow's
# GenAI jobs, which nothing here submits, and costs start-up time and memory).
MLFLOW_SERVER_ENV = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
# The browser tests' screenshots, failure captures (FAILED-<test>.png/.txt) and service logs.
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts" / "ui"
# The walk-through's screenshots (README, "Using the UIs"): kept in the repository, rewritten by
# tests/test_ui_actions.py; everything else in ARTIFACTS is one test session's output.
WALKTHROUGH = re.compile(r"\d\d-[a-z0-9-]+\.png")


def cli_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DAGSTER_", "MLFLOW_", "GHOSTVIS_"))}
    env.update(
        GHOSTVIS_HOME=str(home),
        DAGSTER_HOME=str(home / "dagster"),
        GHOSTVIS_PRESET="smoke",
        PYTHONUNBUFFERED="1",
        **extra,
    )
    return env


def free_ports(n: int) -> list[int]:
    """n distinct ports of 127.0.0.1 that nothing listened on when asked (bound together, then released):
    for a server a test starts, or a connection-refused case."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def free_port() -> int:
    return free_ports(1)[0]


# Worker w's reserved ports: 30000 + 1000 w, 30001 + 1000 w, ... (below the kernel's ephemeral range, 32768-60999).
_RESERVED_PORTS = itertools.count(30000 + 1000 * int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")))


def reserved_port() -> int:
    """A port of 127.0.0.1 for a listener that binds it well after the test chose it, or binds it again: a
    multi-node job's c10d rendezvous (a Slurm relaunch after a preemption binds it minutes later), a server started
    again after an outage. A `free_port()` is in the kernel's ephemeral range, where any process may be given it
    meanwhile: a relaunched job's own srun once listened on it for its tasks' messages, its torchrun agents
    connected to srun instead of hosting the rendezvous, and the job failed. These ports are below that range, and
    none is given twice in a session."""
    return next(_RESERVED_PORTS)


def run_cli(args: list[str], home: Path, timeout: float = 600, check: bool = True, **extra: str):
    """Run a console script of this venv (ghostvis, dagster, torchrun, mlflow) against `home`."""
    exe = str(BIN / args[0]) if (BIN / args[0]).exists() else args[0]
    proc = subprocess.run(
        [exe, *args[1:]],
        env=cli_env(home, **extra),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=Path(__file__).resolve().parent.parent,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


def prepare_argv(stage: str, *sets: str, preset: str = "smoke") -> list[str]:
    """`ghostvis prepare S --preset P --set k=v ...`: plan a stage run by hand, as a user does before torchrun."""
    return ["ghostvis", "prepare", stage, "--preset", preset, *(a for s in sets for a in ("--set", s))]


def prepare_stage(home: Path, stage: str, *sets: str, preset: str = "smoke", **env: str) -> list[str]:
    """`ghostvis prepare` plans the run in `home` (with `env` added, as the job will see it): the torchrun line it
    printed, split; its last argument is the run's launch spec."""
    printed = run_cli(prepare_argv(stage, *sets, preset=preset), home, **env).stdout
    cmd = shlex.split(printed.strip().splitlines()[-1])
    assert cmd[0] == "torchrun" and cmd[-2] == "--spec", f"ghostvis prepare printed {printed!r}"
    return cmd


def torchrun_stage(home: Path, stage: str, *sets: str, preset: str = "smoke", **env: str) -> list[str]:
    """A stage under plain torchrun, as a user runs it: the line `ghostvis prepare` printed, with this
    environment's torchrun."""
    return [str(BIN / "torchrun"), *prepare_stage(home, stage, *sets, preset=preset, **env)[1:]]


def copy_home(src: Path, dest: Path) -> Path:
    """Copy a GHOSTVIS_HOME, hard-linking its write-once files (committed checkpoint steps, MLflow
    artifacts) instead of copying them: the suite copies the demo home dozens of times, which would
    otherwise write tens of GB. Nothing rewrites a committed step in place (a test that breaks a
    checkpoint writes a new file), so the copies stay independent.

    The shared demo home is read by commands on other workers while it is copied: each opens the
    Dagster and MLflow SQLite databases in WAL mode, which makes a `-shm` and a `-wal` file beside
    each and removes them at its close. The `-shm` index belongs to the open connections (SQLite
    rebuilds it from the `-wal`), so the copy leaves it out; a `-wal` is copied when it is there (a
    killed process leaves its writes in one) and skipped when a reader's close removed it meanwhile."""

    def link_or_copy(source: str, target: str) -> None:
        parts = Path(source).relative_to(src).parts
        write_once = parts[0] == "mlartifacts" or any(
            a == "checkpoints" and any(p.startswith("step_") for p in parts[i + 1 :]) for i, a in enumerate(parts)
        )
        if write_once:
            try:
                os.link(source, target)
                return
            except OSError:  # another filesystem
                pass
        try:
            shutil.copy2(source, target)
        except FileNotFoundError:
            if not source.endswith("-wal"):
                raise

    shutil.copytree(src, dest, symlinks=True, copy_function=link_or_copy, ignore=shutil.ignore_patterns("*-shm"))
    return dest


def built_timed(build: Callable[[str, Path], list], sources: list[str], root: Path) -> dict[str, tuple[list, float]]:
    """Each source built by `build(source, folder)` into root/<source>: its shards and its build time (s)."""
    result = {}
    for source in sources:
        start = time.perf_counter()
        shards = build(source, root / source)
        result[source] = (shards, time.perf_counter() - start)
    return result


def shared_dir(tmp_path_factory, name: str) -> Path:
    """A folder this session's pytest-xdist workers share (the session's own base folder without xdist)."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if "PYTEST_XDIST_WORKER" in os.environ else base) / name


@pytest.fixture(scope="module")
def module_tmp(request, tmp_path_factory) -> Iterator[Callable[[str], Path]]:
    """`tmp_path_factory.mktemp` for a test file's module fixtures, removed with the file's last test unless one of
    its tests failed: the retention pytest gives `tmp_path` (pyproject: "failed"), which it does not give folders
    made with the factory. Without it every copy of the demo home, S3 chain and planted run stayed until the session
    ended (9.5 GB of folders when the suite ended)."""
    made: list[Path] = []
    failed_before = request.session.testsfailed

    def mktemp(name: str) -> Path:
        made.append(tmp_path_factory.mktemp(name))
        return made[-1]

    yield mktemp
    if request.session.testsfailed == failed_before:
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def built_once(folder: Path) -> Iterator[bool]:
    """True for the one worker that builds `folder`; the others wait for it, then get False. A build that
    fails leaves no mark, so the next worker tries (and reports) it again."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    done = folder.parent / f"{folder.name}.built"
    with open(folder.parent / f"{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield not done.exists()
        done.touch()


# The order of the files (each runs whole on one worker): the file that builds the demo home and uses it longest
# first; then the files that need no demo (the other worker's work while the demo is built); then the rest. Within
# each group the files that take minutes go first, longest first, so that the last files to run are short ones.
DEMO_FIXTURES = {"demo_home", "home_copy", "pretrain_reference"}
# The session demo's build (`ghostvis demo --preset smoke`): 617 s in CI on 2 bf16 cores, 753 s on 2 fp32-only ones,
# beside the other worker's S3 chain. Whichever test first asks for the demo waits for it inside its own timeout, so
# every test that may ask gets this budget on top of the suite's per-test timeout.
DEMO_BUILD_TIMEOUT = 1200
FIRST_FILE = "test_audit.py"
LONG_FILES = [
    "test_s3_store_chain.py",
    "test_own_data.py",
    "test_own_data_walk.py",
    "test_ui_actions.py",
    "test_slurm.py",
    "test_separate_hosts.py",
    "test_interrupts.py",
    "test_e2e_demo.py",
    "test_cache.py",
    "test_own_stages.py",
    "test_ui_browser.py",
    "test_postgres.py",
    "test_resume.py",
    "test_multinode.py",
    "test_mlflow_outage.py",
]


def pytest_configure(config) -> None:
    """Give this process Python's own SIGINT handler when it was started with SIGINT ignored (in the background, as
    CI and nohup start it). Dagster's in-process execution maps SIGTERM to SIGINT's handler when it leaves
    (dagster/_utils/interrupts.py), so this worker would ignore SIGTERM after its first in-process materialization,
    and so would every process a later test starts: each server or namespace holder stopped with SIGTERM then sat
    out its grace period before SIGKILL."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # This process loads the code location (Dagster definitions, plans) for the demo homes the tests build and
    # read, which cli_env's smoke preset makes in the vlm lineage; unset, the default preset's would be the tiny
    # demo's (rl on reasoning_mix). A test of the selection sets or removes it itself.
    os.environ.setdefault("GHOSTVIS_LINEAGE", "vlm")


def pytest_sessionstart(session) -> None:
    """Remove an earlier session's outputs from ARTIFACTS (the walk-through's screenshots stay), in the
    controlling process only: a worker clearing it when its first browser file starts would delete what
    the other worker's browser tests had already written, failure captures included."""
    if hasattr(session.config, "workerinput"):  # a pytest-xdist worker
        return
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for path in ARTIFACTS.iterdir():
        if not WALKTHROUGH.fullmatch(path.name):
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def pytest_collection_modifyitems(config, items) -> None:
    def group(item) -> int:
        if item.path.name == FIRST_FILE:
            return 0
        return 2 if DEMO_FIXTURES & set(item.fixturenames) else 1

    groups: dict[Path, int] = {}
    for item in items:
        groups[item.path] = max(groups.get(item.path, 0), group(item))

    def order(item) -> tuple[int, int]:
        name = item.path.name
        return groups[item.path], LONG_FILES.index(name) if name in LONG_FILES else len(LONG_FILES)

    items.sort(key=order)  # stable: a file's tests keep their order
    per_test = config.getini("timeout")
    for item in items:
        if DEMO_FIXTURES & set(item.fixturenames) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(float(per_test) + DEMO_BUILD_TIMEOUT))


# The command that builds the session's demo home (a README walk that starts with it starts from a copy instead).
DEMO_COMMAND = ["ghostvis", "demo", "--preset", "smoke"]


@pytest.fixture(scope="session")
def demo_home(tmp_path_factory) -> Path:
    """A GHOSTVIS_HOME after `ghostvis demo --preset smoke` (every asset, every stage), built once per session."""
    home = shared_dir(tmp_path_factory, "ghostvis") / "home"
    with built_once(home) as build:
        if not build:
            return home
        prebuilt = os.environ.get("GHOSTVIS_TEST_DEMO_HOME")  # a developer's shortcut: a home built by this command
        if prebuilt:
            return copy_home(Path(prebuilt), home)
        proc = run_cli(DEMO_COMMAND, home, timeout=DEMO_BUILD_TIMEOUT)
        (home / "demo_stdout.txt").write_text(proc.stdout)
    return home


@pytest.fixture
def home_copy(demo_home, tmp_path) -> Path:
    """A private copy of the demo home, for tests that break or extend it."""
    return copy_home(demo_home, tmp_path / "home")


# A short pretraining run that the resume, multi-node and Slurm tests share: 12 steps of the smoke
# preset (2 ranks, 4 x 256 tokens each), a checkpoint every 4.
SHORT_PRETRAIN = {"budget.steps": "12", "checkpoint.every_steps": "4"}


def materialize(asset: str, *args: str, config: dict | None = None) -> list[str]:
    """The `dagster asset materialize` command line of `asset` in GhostVis's definitions: `args` (a
    partition, say) after the selection, `config` given as --config-json."""
    line = ["dagster", "asset", "materialize", "--select", asset, *args, "-m", "ghostvis_pipeline.definitions"]
    return [*line, "--config-json", json.dumps(config)] if config is not None else line


def materialize_pretrain(**launcher) -> list[str]:
    """The short pretraining run, launched by the given launcher config."""
    run = {"ops": {"pretrain": {"config": {"preset": "smoke", "overrides": SHORT_PRETRAIN}}}}
    if launcher:
        run["resources"] = {"launcher": {"config": launcher}}
    return materialize("pretrain", config=run)


def new_run_dirs(home: Path, known: set[str]) -> list[Path]:
    """Pretrain run folders in `home`'s store that are not in `known`, oldest first (a folder store's
    `fetch` is the run's own folder, which a test watches while the run writes it)."""
    from ghostvis_core.home import Home

    store = Home(home).store
    return [store.fetch("checkpoints", *key) for key in store.keys("checkpoints", "pretrain") if key[1] not in known]


def run_names(home: Path) -> set[str]:
    from ghostvis_core.home import Home

    return {run_key for _, run_key in Home(home).store.keys("checkpoints", "pretrain")}


@pytest.fixture(scope="session")
def pretrain_reference(demo_home, tmp_path_factory) -> tuple[Path, Path]:
    """The short pretraining run, uninterrupted, 2 ranks on this machine (the `local` launcher):
    (its home, its run folder). Other launchers and resumed runs must end exactly here."""
    home = shared_dir(tmp_path_factory, "reference") / "home"
    with built_once(home) as build:
        if build:
            copy_home(demo_home, home)
            run_cli(materialize_pretrain(), home)
    return home, new_run_dirs(home, run_names(demo_home))[-1]


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium for a browser test module (tests/ui_servers.py)."""
    from tests.ui_servers import chromium

    with chromium() as b:
        yield b


@pytest.fixture
def page(browser, request):
    """A fresh page of the browser, the size of the test module's VIEWPORT (width, height), saved as
    FAILED-<test>.png when the test fails (tests/ui_servers.py's captured_page)."""
    from tests.ui_servers import captured_page

    with captured_page(browser, request, *request.module.VIEWPORT) as pg:
        yield pg


@pytest.fixture(scope="session")
def moto_server():
    """A real S3 endpoint (moto's server) on 127.0.0.1, started once per worker: its URL."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture(scope="module")
def moto_s3(moto_server):
    """The S3 endpoint for a test file: its URL. Clients are given the endpoint and test credentials explicitly
    (`s3_env`), never the machine's own AWS settings. The file's buckets are dropped when it ends (moto's reset):
    moto keeps each object in a deleted temporary file on the disk while the server lives, so the S3 chain's
    demo, the Slurm and FSDP runs held their objects until the session ended (the suite's peak disk, measured by
    benchmarks/suite_time.py: 8.5 GB before the reset, 6.5 GB with it)."""
    import urllib.request

    yield moto_server
    urllib.request.urlopen(urllib.request.Request(f"{moto_server}/moto-api/reset", method="POST"), timeout=60).close()


def s3_env(endpoint: str, tmp: Path) -> dict[str, str]:
    """Environment for S3 clients of the moto endpoint (the usual AWS variables, as a user sets them)."""
    return {
        "AWS_ENDPOINT_URL_S3": endpoint,
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": str(tmp / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp / "no-aws-credentials"),
    }


def new_bucket(endpoint: str, name: str) -> None:
    import boto3

    boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="test", aws_secret_access_key="test"
    ).create_bucket(Bucket=name)


@dataclass
class StoreNodes:
    """One artifact store as two nodes see it, and where its artifacts are named (`located(relative)`)."""

    writer: Any
    reader: Any
    located: Callable[[str], str]


@pytest.fixture(params=["folder", "s3"])
def store_nodes(request, tmp_path, monkeypatch) -> StoreNodes:
    """Each store implementation, for tests that must hold for both: a folder store (both nodes see the
    same folder) and a bucket store on moto's S3 server (each node with its own cache folder)."""
    from ghostvis_core.store import FolderStore, S3Store

    if request.param == "folder":
        root = tmp_path / "store"
        return StoreNodes(FolderStore(root), FolderStore(root), lambda rel: str(root / rel))
    endpoint = request.getfixturevalue("moto_s3")
    for var, value in s3_env(endpoint, tmp_path).items():
        monkeypatch.setenv(var, value)
    bucket = f"b-{uuid.uuid4().hex[:10]}"
    new_bucket(endpoint, bucket)
    return StoreNodes(
        S3Store(bucket, "store", tmp_path / "node-a"),
        S3Store(bucket, "store", tmp_path / "node-b"),
        lambda rel: f"s3://{bucket}/store/{rel}",
    )

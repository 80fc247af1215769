"""The MLflow tracking server goes away mid-run: training goes on, metrics are buffered and sent
once the server is back, and the outage is reported (a real `mlflow server` on 127.0.0.1)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from ghostvis_core.data.ledger import Ledger
from ghostvis_core.home import Home
from ghostvis_core.runs.lookup import run_result
from tests.conftest import MLFLOW_SERVER_ENV, cli_env, reserved_port, torchrun_stage
from tests.ui_servers import mlflow_server_command

pytestmark = pytest.mark.e2e


def start_server(port: int, store: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        mlflow_server_command(port, f"sqlite:///{store / 'mlflow.db'}", "--default-artifact-root", str(store / "art")),
        env={**os.environ, **MLFLOW_SERVER_ENV},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise AssertionError("mlflow server did not start")


def stop_server(proc: subprocess.Popen) -> None:
    import os
    import signal

    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(30)


def test_training_survives_an_mlflow_outage_and_the_metrics_arrive_complete(home_copy, tmp_path):
    from mlflow.tracking import MlflowClient

    port, store = reserved_port(), tmp_path / "mlflow"  # started again on it after the outage
    uri = f"http://127.0.0.1:{port}"
    server = start_server(port, store)
    steps = 20
    train = subprocess.Popen(
        torchrun_stage(
            home_copy,
            "pretrain",
            f"budget.steps={steps}",
            "runtime.log_every_steps=1",
            "checkpoint.every_steps=10",
            MLFLOW_TRACKING_URI=uri,
            OMP_NUM_THREADS="1",
        ),
        env=cli_env(home_copy, MLFLOW_TRACKING_URI=uri, OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    client = MlflowClient(uri)
    run_id = None
    deadline = time.time() + 120
    while time.time() < deadline and run_id is None:  # wait for the first step's metrics
        exp = client.get_experiment_by_name("ghostvis")
        runs = client.search_runs([exp.experiment_id]) if exp else []
        if runs and "tokens/real" in runs[0].data.metrics:
            run_id = runs[0].info.run_id
        time.sleep(0.2)
    assert run_id, "training never logged to MLflow"
    stop_server(server)
    down_at_ms = int(time.time() * 1000)
    time.sleep(6)
    assert train.poll() is None, "training stopped while the MLflow server was down"
    server = start_server(port, store)
    up_at_ms = int(time.time() * 1000)
    try:
        out, _ = train.communicate(timeout=600)
        assert train.returncode == 0, out[-3000:]
        history = client.get_metric_history(run_id, "tokens/real")
        assert sorted(int(m.step) for m in history) == list(range(1, steps + 1))  # no gap left
        # Steps trained while the server was down carry their own time: they were buffered, not re-timed on arrival.
        during_outage = [m.step for m in history if down_at_ms <= m.timestamp <= up_at_ms]
        assert during_outage, f"no step was logged during the outage ({down_at_ms}..{up_at_ms} ms)"
        run_key = client.get_run(run_id).data.tags["ghostvis.run_key"]
        done = run_result(Home(home_copy).store, "pretrain", run_key)
        ledger = Ledger.in_store(Home(home_copy).store)
        assert max(m.value for m in history) == done.counts.real_tokens == ledger.run_counts(run_key).real_tokens
        delivery = done.mlflow_delivery
        assert delivery["failed_flushes"] >= 1 and delivery["gap_seconds"] > 0  # the outage is reported
        assert delivery["unsent_metrics"] == 0
        assert client.get_run(run_id).info.status == "FINISHED"
    finally:
        stop_server(server)


def test_a_tracking_store_mlflow_refuses_to_open_is_reported_at_once_not_after_the_timeouts(tmp_path, monkeypatch):
    """MLflow 3.17 refuses its filesystem store in MlflowClient's constructor: the run says so within
    seconds instead of waiting out wait_run_id's and finish's timeouts."""
    from ghostvis_core.run.track.mlflow_run import MlflowRun, MlflowTarget

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    start = time.monotonic()
    run = MlflowRun(MlflowTarget(f"file:{tmp_path / 'mlruns'}", "ghostvis"), {"a": 1})
    with pytest.raises(RuntimeError, match="could not be created at file:.*filesystem tracking backend"):
        run.wait_run_id(timeout=60)
    run.finish(timeout=60)
    assert time.monotonic() - start < 30


def test_an_mlflow_missing_a_requirement_is_reported_at_once(tmp_path):
    """On the GPU machine MLflow's import failed (no pydantic) inside the logger thread and the run
    waited out wait_run_id's 120 s before saying only "not created": the import error is the error."""
    code = f"""
import importlib.abc, sys, time
class NoPydantic(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "pydantic":
            raise ModuleNotFoundError("No module named 'pydantic'")
sys.meta_path.insert(0, NoPydantic())
from ghostvis_core.run.track.mlflow_run import MlflowRun, MlflowTarget
start = time.monotonic()
run = MlflowRun(MlflowTarget("sqlite:///{tmp_path / "mlflow.db"}", "ghostvis"), {{"a": 1}})
try:
    run.wait_run_id(timeout=60)
except RuntimeError as exc:
    print(f"{{time.monotonic() - start:.1f}}", exc)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    seconds, message = proc.stdout.strip().split(" ", 1)
    assert float(seconds) < 30, proc.stdout
    assert message.startswith("MLflow run could not be created at sqlite:") and "No module named 'pydantic'" in message

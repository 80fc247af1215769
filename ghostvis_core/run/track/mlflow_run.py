"""MLflow logging from rank 0, off the training thread.

mlflow is imported and the run created in a background thread, which the tracker starts after the
first optimizer step (ghostvis_core/run/train/live_metrics.py says why). Metrics are buffered and sent in
batches; if the tracking server is unreachable the buffer is kept and retried, training goes on, and
the outage is reported as a gap.
For that, mlflow's HTTP client must fail fast, or one flush blocks for minutes of retries: the
launcher sets MLFLOW_HTTP_REQUEST_MAX_RETRIES=0 and MLFLOW_HTTP_REQUEST_TIMEOUT=10 in the training
process's environment (this module leaves the environment alone).
The dataset inputs (mlflow_inputs) and the system metrics (mlflow_system) travel the same way.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ghostvis_core.plan.config import flatten

# The experiment tag MLflow's tools read for the kind of experiment: model training (runs, metrics,
# models), not GenAI (traces, prompts). MLflow's UI (3.17, 3.18) does not read it; its view comes from the URL's
# `workflowType`, which is why GhostVis's MLflow links carry `workflowType=machine_learning`.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MODEL_TRAINING_KIND = "custom_model_development"


@dataclass
class MlflowTarget:
    tracking_uri: str
    experiment: str
    artifact_location: str | None = None
    run_name: str = ""
    run_id: str | None = None  # set: continue this run (resume) instead of creating one
    tags: dict[str, str] = field(default_factory=dict)


@dataclass
class _Outbox:
    """What the background thread has yet to send, and since when sending has failed."""

    metrics: list = field(default_factory=list)
    tags: list = field(default_factory=list)
    artifacts: list = field(default_factory=list)  # (path, artifact_path)
    inputs: list = field(default_factory=list)  # mlflow DatasetInput
    down_since: float | None = None
    finishing: tuple[str, float] | None = None  # (status, deadline) once finish() was called

    def empty(self) -> bool:
        return not (self.metrics or self.tags or self.artifacts or self.inputs)


class MlflowRun:
    def __init__(self, target: MlflowTarget, params: dict[str, Any], flush_every_s: float = 2.0):
        self.target = target
        self._params = {k: str(v)[:6000] for k, v in flatten(params).items()}
        self._flush_every = flush_every_s
        self._q: queue.Queue = queue.Queue()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self.run_id: str | None = target.run_id
        self.experiment_id: str | None = None
        self.failed_flushes = 0
        self.gap_seconds = 0.0
        self.unsent = 0
        self._system = None  # the system metrics sampler, started with the run
        self._thread = threading.Thread(target=self._worker, name="mlflow-logger", daemon=True)
        self._thread.start()

    # ---- called from the training thread ----
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._q.put(("metrics", metrics, step, int(time.time() * 1000)))

    def set_tags(self, tags: dict[str, str]) -> None:
        self._q.put(("tags", tags, 0, 0))

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None:
        self._q.put(("artifact", path, artifact_path, 0))

    def log_inputs(self, shards: list) -> None:
        """The run's dataset inputs, one per mlflow_inputs.ShardInput."""
        self._q.put(("inputs", shards, 0, 0))

    def wait_run_id(self, timeout: float = 120.0) -> str:
        if not self._started.wait(timeout):
            raise RuntimeError(f"MLflow run was not created within {timeout:.0f}s ({self.target.tracking_uri})")
        if self._error is not None:
            raise RuntimeError(f"MLflow run could not be created at {self.target.tracking_uri}: {self._error}")
        return self.run_id  # type: ignore[return-value]

    def finish(self, status: str = "FINISHED", timeout: float = 300.0) -> dict[str, Any]:
        """Stop sampling system metrics, flush everything (retrying while the server is down, up to
        timeout) and end the run."""
        if self._started.wait(timeout) and self._system is not None:
            self._system.finish()  # its last sample is queued before the finish item
        self._q.put(("finish", status, timeout, 0))
        self._thread.join(timeout + 30)
        return {
            "failed_flushes": self.failed_flushes,
            "gap_seconds": round(self.gap_seconds, 1),
            "unsent_metrics": self.unsent,
        }

    # ---- background thread ----
    def _worker(self) -> None:
        """Thread body: create (or resume) the run, then deliver queued items until finish()."""
        if self._connect():
            self._deliver()

    def _connect(self) -> bool:
        """Import mlflow and start the run here, off the training thread; False (the error kept for
        wait_run_id) if that failed."""
        try:  # the import and the client too: an MLflow missing a requirement (pydantic, on a GPU machine) or
            # refusing to build (a `file:` store in 3.17) left the run waiting for wait_run_id's timeout
            from mlflow.entities import Metric, Param, RunTag
            from mlflow.tracking import MlflowClient

            self._Metric, self._Param, self._RunTag = Metric, Param, RunTag
            self._client = MlflowClient(tracking_uri=self.target.tracking_uri)
            self._start_run(self._client)
            self._start_system_metrics()
        except BaseException as exc:  # surfaced through wait_run_id
            self._error = exc
            return False
        finally:
            self._started.set()
        return True

    def _start_system_metrics(self) -> None:
        """Sample CPU, memory (and GPU) into this run until finish(); a resumed run continues its steps."""
        from ghostvis_core.run.track.mlflow_system import OutboxSystemMetrics

        self._system = OutboxSystemMetrics(
            self.run_id, self.target.tracking_uri, self.log_metrics, resume=bool(self.target.run_id)
        )
        self._system.start()

    def _deliver(self) -> None:
        """Buffer queued items and flush them every flush_every_s (at once when finishing)."""
        out = _Outbox()
        last_flush = time.time()
        while True:
            self._take(out, self._next_item())
            due = out.finishing is not None or time.time() - last_flush >= self._flush_every
            if due and not out.empty():
                self._flush(out)
                last_flush = time.time()
            if out.finishing is not None:
                if self._end_if_done(out):
                    return
                time.sleep(1.0)

    def _next_item(self) -> tuple | None:
        """The next queued item, or None after half a second so a due flush is not held up."""
        try:
            return self._q.get(timeout=0.5)
        except queue.Empty:
            return None

    def _take(self, out: _Outbox, item: tuple | None) -> None:
        """Move one queued item into the outbox; finish() records its status and deadline."""
        if item is None:
            return
        kind = item[0]
        if kind == "metrics":
            _, metrics, step, ts = item
            out.metrics += [self._Metric(k, float(v), ts, step) for k, v in metrics.items()]
        elif kind == "tags":
            out.tags += [self._RunTag(k, str(v)) for k, v in item[1].items()]
        elif kind == "artifact":
            out.artifacts.append((item[1], item[2]))
        elif kind == "inputs":
            from ghostvis_core.run.track.mlflow_inputs import dataset_input

            out.inputs += [dataset_input(s) for s in item[1]]
        elif kind == "finish":
            out.finishing = (item[1], time.time() + item[2])

    def _flush(self, out: _Outbox) -> None:
        """Send the outbox; while the server is down keep it for the next flush and time the gap."""
        try:
            self._send(out)
            if out.down_since is not None:
                self.gap_seconds += time.time() - out.down_since
                out.down_since = None
        except Exception:  # server down: keep the buffer, retry at the next flush
            self.failed_flushes += 1
            out.down_since = out.down_since or time.time()

    def _send(self, out: _Outbox) -> None:
        """Metrics and tags in batches of 1000, dataset inputs, then artifacts one by one; each leaves
        the outbox once sent."""
        for i in range(0, max(len(out.metrics), 1), 1000):
            self._client.log_batch(self.run_id, metrics=out.metrics[i : i + 1000], tags=out.tags if i == 0 else [])
        out.metrics, out.tags = [], []
        if out.inputs:
            self._client.log_inputs(self.run_id, datasets=out.inputs)
            out.inputs = []
        while out.artifacts:
            path, apath = out.artifacts[0]
            self._client.log_artifact(self.run_id, path, apath)
            out.artifacts.pop(0)

    def _end_if_done(self, out: _Outbox) -> bool:
        """End the run once everything is sent, or as FAILED past finish()'s deadline; True if ended."""
        status, deadline = out.finishing
        done = out.empty()
        if not done and time.time() <= deadline:
            return False
        try:
            self._client.set_terminated(self.run_id, status if done else "FAILED")
        except Exception:
            self.failed_flushes += 1
        self.unsent = len(out.metrics)
        return True

    def _start_run(self, client) -> None:
        t = self.target
        if t.run_id:
            self.experiment_id = client.get_run(t.run_id).info.experiment_id
            client.update_run(t.run_id, status="RUNNING")
            client.log_batch(t.run_id, tags=[self._RunTag(k, v) for k, v in t.tags.items()])
            return
        self.experiment_id = exp_id = self._experiment(client)
        run = client.create_run(exp_id, run_name=t.run_name, tags=t.tags)
        self.run_id = run.info.run_id
        params = [self._Param(k, v) for k, v in self._params.items()]
        for i in range(0, len(params), 100):
            client.log_batch(self.run_id, params=params[i : i + 100])

    def _experiment(self, client) -> str:
        """The experiment's id, created as a model-training experiment if missing (an experiment made
        before it carried the kind gets it)."""
        t = self.target
        exp = client.get_experiment_by_name(t.experiment)
        if exp is None:
            try:
                return client.create_experiment(
                    t.experiment, artifact_location=t.artifact_location, tags={EXPERIMENT_KIND_TAG: MODEL_TRAINING_KIND}
                )
            except Exception:  # created concurrently by another run
                exp = client.get_experiment_by_name(t.experiment)
        if EXPERIMENT_KIND_TAG not in exp.tags:
            client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND)
        return exp.experiment_id

"""MLflow logging from rank 0, off the training thread.

mlflow is imported and the run created in a background thread, so the first optimizer step does
not wait for it. Metrics are buffered and sent in batches; if the tracking server is unreachable
the buffer is kept and retried, training goes on, and the outage is reported as a gap.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ghostvis_core.config import flatten


@dataclass
class MlflowTarget:
    tracking_uri: str
    experiment: str
    artifact_location: str | None = None
    run_name: str = ""
    run_id: str | None = None  # set: continue this run (resume) instead of creating one
    tags: dict[str, str] = field(default_factory=dict)


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
        self._thread = threading.Thread(target=self._worker, name="mlflow-logger", daemon=True)
        self._thread.start()

    # ---- called from the training thread ----
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._q.put(("metrics", metrics, step, int(time.time() * 1000)))

    def set_tags(self, tags: dict[str, str]) -> None:
        self._q.put(("tags", tags, 0, 0))

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None:
        self._q.put(("artifact", path, artifact_path, 0))

    def wait_run_id(self, timeout: float = 120.0) -> str:
        if not self._started.wait(timeout):
            raise RuntimeError(f"MLflow run was not created within {timeout:.0f}s ({self.target.tracking_uri})")
        if self._error is not None:
            raise RuntimeError(f"MLflow run could not be created at {self.target.tracking_uri}: {self._error}")
        return self.run_id  # type: ignore[return-value]

    def finish(self, status: str = "FINISHED", timeout: float = 300.0) -> dict[str, Any]:
        """Flush everything (retrying while the server is down, up to timeout) and end the run."""
        self._q.put(("finish", status, timeout, 0))
        self._thread.join(timeout + 30)
        return {"failed_flushes": self.failed_flushes, "gap_seconds": round(self.gap_seconds, 1),
                "unsent_metrics": self.unsent}

    # ---- background thread ----
    def _worker(self) -> None:
        # Fail fast inside mlflow's HTTP client: this thread keeps the buffer and retries itself,
        # so an outage costs a gap in delivery, not minutes of blocked retries.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.tracking import MlflowClient

        self._Metric, self._Param, self._RunTag = Metric, Param, RunTag
        client = MlflowClient(tracking_uri=self.target.tracking_uri)
        self._client = client
        try:
            self._start_run(client)
        except BaseException as exc:  # surfaced through wait_run_id
            self._error = exc
            self._started.set()
            return
        self._started.set()
        pending_metrics: list = []
        pending_tags: list = []
        pending_artifacts: list = []
        last_flush = time.time()
        down_since: float | None = None
        finishing: tuple | None = None
        while True:
            try:
                item = self._q.get(timeout=0.5)
            except queue.Empty:
                item = None
            if item is not None:
                kind = item[0]
                if kind == "metrics":
                    _, metrics, step, ts = item
                    pending_metrics += [Metric(k, float(v), ts, step) for k, v in metrics.items()]
                elif kind == "tags":
                    pending_tags += [RunTag(k, str(v)) for k, v in item[1].items()]
                elif kind == "artifact":
                    pending_artifacts.append((item[1], item[2]))
                elif kind == "finish":
                    finishing = (item[1], time.time() + item[2])
            due = finishing is not None or time.time() - last_flush >= self._flush_every
            if due and (pending_metrics or pending_tags or pending_artifacts):
                try:
                    for i in range(0, max(len(pending_metrics), 1), 1000):
                        client.log_batch(self.run_id, metrics=pending_metrics[i : i + 1000],
                                         tags=pending_tags if i == 0 else [])
                    pending_metrics, pending_tags = [], []
                    while pending_artifacts:
                        path, apath = pending_artifacts[0]
                        client.log_artifact(self.run_id, path, apath)
                        pending_artifacts.pop(0)
                    if down_since is not None:
                        self.gap_seconds += time.time() - down_since
                        down_since = None
                except Exception:  # server down: keep the buffer, retry at the next flush
                    self.failed_flushes += 1
                    down_since = down_since or time.time()
                last_flush = time.time()
            if finishing is not None:
                done = not (pending_metrics or pending_tags or pending_artifacts)
                if done or time.time() > finishing[1]:
                    try:
                        client.set_terminated(self.run_id, finishing[0] if done else "FAILED")
                    except Exception:
                        self.failed_flushes += 1
                    self.unsent = len(pending_metrics)
                    return
                time.sleep(1.0)

    def _start_run(self, client) -> None:
        t = self.target
        if t.run_id:
            self.experiment_id = client.get_run(t.run_id).info.experiment_id
            client.update_run(t.run_id, status="RUNNING")
            client.log_batch(t.run_id, tags=[self._RunTag(k, v) for k, v in t.tags.items()])
            return
        exp = client.get_experiment_by_name(t.experiment)
        if exp is None:
            try:
                exp_id = client.create_experiment(t.experiment, artifact_location=t.artifact_location)
            except Exception:  # created concurrently by another run
                exp_id = client.get_experiment_by_name(t.experiment).experiment_id
        else:
            exp_id = exp.experiment_id
        self.experiment_id = exp_id
        run = client.create_run(exp_id, run_name=t.run_name, tags=t.tags)
        self.run_id = run.info.run_id
        params = [self._Param(k, v) for k, v in self._params.items()]
        for i in range(0, len(params), 100):
            client.log_batch(self.run_id, params=params[i : i + 100])

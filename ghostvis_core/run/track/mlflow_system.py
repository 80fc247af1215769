"""System metrics of a stage run (CPU, memory, disk, network; GPU when nvidia-ml-py or pyrocml finds
one), shown on the run's "System metrics" tab: MLflow's SystemMetricsMonitor samples them, and the
samples travel through the run's outbox (mlflow_run.MlflowRun) like the training metrics.

MLflow's own loop sends each sample itself and asks the server for the run's status after every
sample, giving up for good at the first failure; here an MLflow outage only delays the samples, and
sampling stops when the run's outbox is finished (a run shorter than one interval gets one sample
over its whole length). Imported by the logging thread only.
"""

from __future__ import annotations

from collections.abc import Callable

import psutil
from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

# Seconds between samples: a demo stage lasts well under a minute. MLflow's MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL
# (and MLFLOW_SYSTEM_METRICS_SAMPLES_BEFORE_LOGGING, to average several samples per point) override it.
SAMPLE_EVERY_S = 2.0


class OutboxSystemMetrics(SystemMetricsMonitor):
    """MLflow's sampler whose points go to `log(metrics, step)` (the run's outbox)."""

    def __init__(self, run_id: str, tracking_uri: str, log: Callable[[dict[str, float], int], None], resume: bool):
        super().__init__(run_id, sampling_interval=SAMPLE_EVERY_S, resume_logging=resume, tracking_uri=tracking_uri)
        self._log = log

    def monitor(self) -> None:
        """Sample every interval and publish every samples_before_logging samples, until finish()."""
        psutil.cpu_percent()  # the next reading then covers the interval, not the time since boot
        taken = 0
        while not self._shutdown_event.wait(self.sampling_interval):
            self.collect_metrics()
            taken += 1
            if taken % self.samples_before_logging == 0:
                self.publish_metrics(self.aggregate_metrics())
        if taken == 0:
            self.collect_metrics()  # a run shorter than one interval: one sample over the whole run
        if taken == 0 or taken % self.samples_before_logging:
            self.publish_metrics(self.aggregate_metrics())

    def publish_metrics(self, metrics: dict[str, float]) -> None:
        prefix = self._metrics_prefix + (f"{self.node_id}/" if self.node_id else "")
        self._log({prefix + k: v for k, v in metrics.items()}, self._logging_step)
        self._logging_step += 1
        for m in self.monitors:
            m.clear_metrics()

"""Data stages on a Slurm cluster: a datatrove pipeline (tokenization) as a Slurm job array through
datatrove's own SlurmPipelineExecutor, one array task per shard, waited for like a local run.

The logging folder (datatrove's pickled pipeline, its completions and each task's log) must be on a
filesystem the nodes share; each task opens the artifact store from its URI.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from datatrove.executor import SlurmPipelineExecutor

from ghostvis_core.errors import GhostvisError
from ghostvis_core.launch.cluster.slurm_script import SlurmJob


@dataclass
class SlurmPipeline:
    """Runs a datatrove pipeline on Slurm with a launcher's job settings (partition, time, account,
    QoS, set-up lines); `tokenize_shards(..., run_pipeline=SlurmPipeline(job))`."""

    job: SlurmJob

    def __call__(self, pipeline: list, tasks: int, workers: int, logging_dir: Path) -> None:
        logging_dir = logging_dir / f"slurm-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"  # this job's
        executor = SlurmPipelineExecutor(
            pipeline=pipeline,
            tasks=tasks,
            workers=workers,
            time=self.job.time or "24:00:00",
            partition=self.job.partition or default_partition(),
            cpus_per_task=1,
            qos=self.job.qos,
            job_name=f"{self.job.job_name}-tokenize",
            logging_dir=str(logging_dir),
            skip_completed=False,
            sbatch_args={"account": self.job.account} if self.job.account else None,
            requeue=False,
            **node_environment(self.job),
        )
        executor.run()
        wait_until_gone(str(executor.job_id), self.job.poll_seconds)
        missing = [r for r in range(tasks) if not (logging_dir / "completions" / f"{r:05d}").exists()]
        if missing:
            raise GhostvisError(
                f"Slurm job {executor.job_id}: tasks {missing} did not complete; see their logs in "
                f"{logging_dir / 'slurm_logs'}, then re-materialize the partitions (finished "
                "shards are skipped)"
            )


def node_environment(job: SlurmJob) -> dict[str, str]:
    """How a task gets this project's Python: the job's set-up lines, else this venv (nodes that share
    the install see it at the same path)."""
    if job.setup:
        return {"env_command": "\n".join(job.setup)}
    activate = Path(sys.prefix) / "bin" / "activate"
    if not activate.exists():
        raise GhostvisError(
            "slurm launcher: no `setup` lines and no virtualenv to activate on the nodes; give "
            "slurm.setup (e.g. `source /shared/ghostvis/.venv/bin/activate`)"
        )
    return {"venv_path": str(activate)}


def default_partition() -> str:
    """The cluster's default partition (marked `*` by sinfo): datatrove needs a name."""
    out = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=60).stdout.split()
    marked = [p.rstrip("*") for p in out if p.endswith("*")]
    if not marked:
        raise GhostvisError("slurm: the cluster has no default partition; set the launcher's slurm.partition")
    return marked[0]


def wait_until_gone(job_id: str, poll_seconds: float) -> None:
    """Until the job (every array task) has left the queue."""
    while subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True, timeout=60).stdout.strip():
        time.sleep(poll_seconds)

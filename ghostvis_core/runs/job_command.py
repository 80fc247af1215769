"""What a launcher starts: one heavy job, a module run under torchrun on a spec in the store.

Training (`ghostvis_core.run`), the evaluation (`ghostvis_core.verify.eval`), tokenizer training
(`ghostvis_core.run.tokenizer_training`) and a cache hit's model registration (`ghostvis_core.run.hf.register`)
are launched alike, by the same launchers (local torchrun, multi-node torchrun, Slurm, Kubernetes, Pipes),
so none of them runs in the Dagster process. A job's files live in its folder of the store,
runs/<stage>/<run_key>/: the spec it reads, its Pipes messages, output and reasons.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from ghostvis_core.plan.config import RuntimeConfig

TRAINING_ENTRY = "ghostvis_core.run"  # the training job's module


@dataclass(frozen=True)
class Job:
    stage: str  # with run_key: the job's folder in the store (runs/<stage>/<run_key>/)
    run_key: str
    module: str  # run as `python -m <module> --spec <store>/runs/<stage>/<run_key>/spec.json`
    ranks: int  # the world size; a one-rank job runs on one node whatever the launcher's node count
    mlflow_tracking_uri: str  # where the job logs (a pod cannot reach a file on the Dagster host)
    done: tuple[str, ...]  # the store kind and key of the record the job leaves once it completed
    args: tuple[str, ...] = ()  # the module's arguments after --spec (the registration job's --tracking-uri)
    # how the job is watched and stopped (runtime.preempt_grace_s, runtime.hang_timeout_s): a training job's
    # stage config; the defaults for the other jobs
    runtime: RuntimeConfig = RuntimeConfig()


def job_parser(module: str, doc: str | None, spec_help: str) -> argparse.ArgumentParser:
    """The command line every launched job shares, `python -m <module> --spec <URI>` (its docstring as the help);
    a job adds the arguments of its own (Job.args) to it."""
    ap = argparse.ArgumentParser(
        prog=f"python -m {module}", description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--spec", required=True, help=spec_help)
    return ap

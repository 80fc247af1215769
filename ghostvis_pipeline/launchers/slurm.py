"""The `slurm` launcher: one sbatch job (`srun torchrun` on N nodes), followed until it ends, its
output streamed into the Dagster log, cancelled with the Dagster run. Rank 0 reports through Pipes
messages in the shared store; the job's end state decides whether a retry resumes the run."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

from dagster import AssetExecutionContext, DagsterRunStatus, Failure

from ghostvis_core.cluster.slurm import SlurmJob, job_outcome, redact, render_sbatch
from ghostvis_core.errors import GhostvisError
from ghostvis_core.home import Home
from ghostvis_core.train.spec import LaunchSpec
from ghostvis_pipeline.config import config_from_dataclass
from ghostvis_pipeline.launchers.common import clear_reason, failure, job_env, require_result, spec_uri
from ghostvis_pipeline.launchers.pipes import store_pipes_session

SlurmConfig = config_from_dataclass(SlurmJob)


def run_slurm(context: AssetExecutionContext, spec: LaunchSpec, home: Home, launcher) -> None:
    """Submit the run as one job and wait for it: the Dagster step lasts as long as the training does,
    so that Dagster's retry, termination and log cover the job."""
    job = SlurmJob(**launcher.slurm.model_dump())
    nproc = launcher.ranks_per_node(spec)
    attempt = f"{context.run_id[:8]}-{context.retry_number}"
    clear_reason(home, spec)
    with store_pipes_session(context, home, spec, attempt) as session:
        env = {**job_env(launcher.profile, nproc, job.cpus_per_task), **session.get_bootstrap_env_vars()}
        script, output = write_script(home, spec, job, nproc, attempt, env)
        context.log.info(f"sbatch script {script}:\n{redact(script.read_text())}")
        job_id = submit(script, env)
        context.log.info(f"{spec.stage} run {spec.run_key}: Slurm job {job_id}, output {output}")
        state = follow_or_cancel(context, job_id, output, job.poll_seconds)
    context.log.info(f"Slurm job {job_id} ended {state}")
    end(home, spec, job_id, state, output)


def write_script(home: Home, spec: LaunchSpec, job: SlurmJob, nproc: int, attempt: str,
                 env: dict[str, str]) -> tuple[Path, Path]:
    """The job script and its output file, both in the run's folder of the store (every node sees it)."""
    output = home.store.path("run_file", spec.stage, spec.run_key, f"slurm/{attempt}.out")
    try:
        text = render_sbatch(job, spec_uri(home, spec), nproc, str(output), env)
    except GhostvisError as exc:
        raise Failure(str(exc), allow_retries=False) from None
    script = home.store.write_text("run_file", spec.stage, spec.run_key, f"slurm/{attempt}.sbatch", text=text)
    return script, output


def slurm_cli(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """A Slurm client command (sbatch, scontrol, sacct, scancel) on the Dagster host."""
    try:
        return subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise Failure(f"slurm launcher: '{args[0]}' is not on this host's PATH; install the Slurm client "
                      "(`make slurm`) or run Dagster on a login node of the cluster", allow_retries=False) from None


def submit(script: Path, env: dict[str, str]) -> str:
    """The job id. Secrets of this host's environment reach the job through sbatch's environment, not the script."""
    proc = slurm_cli(["sbatch", "--parsable", str(script)], env={**os.environ, **env})
    if proc.returncode != 0:
        raise Failure(f"sbatch refused {script}: {proc.stderr.strip()}; fix the launcher's slurm config "
                      "(partition, account, qos, extra_sbatch) or the cluster", allow_retries=False)
    return proc.stdout.strip().split(";")[0]


def job_state(job_id: str) -> str:
    """The job's state from slurmctld (`scontrol`), or from accounting (`sacct`) once slurmctld has
    forgotten the job (after MinJobAge)."""
    proc = slurm_cli(["scontrol", "-o", "show", "job", job_id])
    found = re.search(r"\bJobState=(\S+)", proc.stdout) if proc.returncode == 0 else None
    if found:
        return found[1]
    acct = slurm_cli(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State"])
    if acct.returncode == 0 and acct.stdout.strip():
        return acct.stdout.strip().splitlines()[0]
    raise Failure(f"Slurm job {job_id}: scontrol does not know it ({proc.stderr.strip()}) and sacct has no record "
                  f"({acct.stderr.strip()}); enable accounting or raise MinJobAge in slurm.conf so that the "
                  "launcher can read how jobs end")


def stream(context: AssetExecutionContext, output: Path, offset: int) -> int:
    """Log the output's complete lines past `offset`; return the offset after them."""
    if not output.exists():
        return offset
    with output.open("rb") as f:
        f.seek(offset)
        data = f.read()
    whole = data[: data.rfind(b"\n") + 1]
    for line in whole.decode(errors="replace").splitlines():
        context.log.debug(line)  # debug: rank 0's own lines also arrive through Pipes, at info
    return offset + len(whole)


def follow(context: AssetExecutionContext, job_id: str, output: Path, poll_seconds: float) -> str:
    """Wait for the job's final state, streaming its output; stop when the Dagster run is terminated."""
    offset = 0
    while True:
        state = job_state(job_id)
        offset = stream(context, output, offset)
        if job_outcome(state) is not None:
            return state
        run = context.instance.get_run_by_id(context.run_id)
        if run is not None and run.status in (DagsterRunStatus.CANCELING, DagsterRunStatus.CANCELED):
            raise Failure(f"Dagster run {context.run_id} was terminated; Slurm job {job_id} is cancelled and not "
                          "retried; materialize the stage again to resume from its newest checkpoint",
                          allow_retries=False)
        time.sleep(poll_seconds)


def follow_or_cancel(context: AssetExecutionContext, job_id: str, output: Path, poll_seconds: float) -> str:
    """Follow the job; if following stops for any reason (interrupt, termination, error), the job
    must not run on unwatched, holding nodes and writing to the run."""
    try:
        return follow(context, job_id, output, poll_seconds)
    except BaseException:
        proc = slurm_cli(["scancel", job_id])
        context.log.warning(f"scancel {job_id}: " + ("done" if proc.returncode == 0 else proc.stderr.strip()))
        raise


def end(home: Home, spec: LaunchSpec, job_id: str, state: str, output: Path) -> None:
    """Map the job's final state: ok needs the run's record; a resumable end asks for a retry; a failed
    one does not (a bug or OOM would recur, a cancel was meant): re-materialize once it is fixed."""
    outcome = job_outcome(state)
    if outcome == "resumable":
        raise Failure(f"{spec.stage} run {spec.run_key}: Slurm job {job_id} ended {state}; a retry or "
                      "re-materialization with the same config resumes the run from its newest checkpoint",
                      allow_retries=True)
    if outcome == "failed":
        raise failure(home, spec, f"Slurm job {job_id} ended {state}; its output is {output}", allow_retries=False)
    require_result(home, spec)


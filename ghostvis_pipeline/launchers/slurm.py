"""The `slurm` launcher: one sbatch job (`srun torchrun` on N nodes), followed until it ends, its
output streamed into the Dagster log, cancelled with the Dagster run. Nothing needs a folder that the
Dagster host shares with the cluster: the script goes to sbatch on its stdin (and into the store, for
people), the job ships its output to the store as it runs (ghostvis_core/run/ship_output.py),
rank 0 reports through Pipes messages in the store, and the job's end state decides whether a retry
resumes the run."""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Callable

from dagster import AssetExecutionContext, DagsterRunStatus, Failure

from ghostvis_core.errors import GhostvisError
from ghostvis_core.home import Home
from ghostvis_core.launch.cluster.slurm_script import SlurmJob, job_outcome, redact, render_sbatch, ship_command
from ghostvis_core.run.ship_output import chunk_name
from ghostvis_core.runs.job_command import Job
from ghostvis_core.store import Store
from ghostvis_pipeline.config import config_from_dataclass
from ghostvis_pipeline.launchers.common import (
    attempt_name,
    failure,
    frozen_watch,
    host_environment,
    require_result,
    spec_uri,
)
from ghostvis_pipeline.launchers.pipes import job_session
from ghostvis_pipeline.launchers.processes import Frozen

SlurmConfig = config_from_dataclass(SlurmJob)


class JobOutput:
    """The job's output as the batch node ships it: numbered chunks (`run_file` slurm/<attempt>/out/<seq>.txt)."""

    def __init__(self, store: Store, target: Job, attempt: str):
        self.store, self.key, self.name = store, (target.stage, target.run_key), f"slurm/{attempt}/out"
        self.shipped = 0  # chunks already logged

    @property
    def uri(self) -> str:
        return self.store.uri_of("run_file", *self.key, self.name)

    def stream(self, context: AssetExecutionContext) -> None:
        """Log the chunks that arrived since the last call, in order, secrets redacted."""
        while self.store.exists("run_file", *self.key, chunk_name(self.name, self.shipped + 1)):
            text = self.store.read_text("run_file", *self.key, chunk_name(self.name, self.shipped + 1))
            for line in text.splitlines():
                context.log.debug(redact(line))  # debug: rank 0's own lines also arrive through Pipes, at info
            self.shipped += 1


def run_slurm(context: AssetExecutionContext, target: Job, home: Home, launcher) -> None:
    """Submit the run as one job and wait for it: the Dagster step lasts as long as the training does,
    so that Dagster's retry, termination and log cover the job."""
    job = slurm_job(launcher, target)
    nproc = launcher.ranks_per_node(target)
    attempt = attempt_name(context)
    output = JobOutput(home.store, target, attempt)
    with job_session(context, home, target, attempt, launcher, nproc, job.cpus_per_task) as env:
        script = job_script(home, target, job, nproc, env, output.name)
        uri = home.store.write_text("run_file", target.stage, target.run_key, f"slurm/{attempt}.sbatch", text=script)
        context.log.info(
            f"sbatch script {uri} (submit it by hand: `ghostvis store cat {uri} | sbatch`):\n{redact(script)}"
        )
        job_id = submit(script, {**host_environment(launcher.send_credentials), **env})  # --export=ALL
        context.log.info(
            f"{target.stage} run {target.run_key}: Slurm job {job_id}, its output arriving at {output.uri}"
        )
        try:
            state = follow_or_cancel(context, job_id, output, job.poll_seconds, frozen_watch(home, target))
        except Frozen as exc:  # cancelled by follow_or_cancel; the stage's retry resumes
            raise failure(home, target, f"{exc}; Slurm job {job_id} cancelled") from None
    context.log.info(f"Slurm job {job_id} ended {state}")
    end(home, target, job_id, state, output.uri)


def slurm_job(launcher, target: Job) -> SlurmJob:
    """The sbatch options of the job: the launcher's, one node and at most one GPU for a one-rank job."""
    return SlurmJob(**launcher.sized(launcher.slurm, target))


def job_script(home: Home, target: Job, job: SlurmJob, nproc: int, env: dict[str, str], out: str) -> str:
    """The job script, its output shipped to the store (`run_file` <out>/<seq>.txt)."""
    ship = ship_command(job, home.store.uri, target.stage, target.run_key, out)
    try:
        return render_sbatch(
            job,
            spec_uri(home, target),
            nproc,
            env,
            ship,
            module=target.module,
            args=target.args,
            grace_s=target.runtime.preempt_grace_s,
        )
    except GhostvisError as exc:
        raise Failure(str(exc), allow_retries=False) from None


def slurm_cli(
    args: list[str], env: dict[str, str] | None = None, stdin: str | None = None
) -> subprocess.CompletedProcess:
    """A Slurm client command (sbatch, scontrol, sacct, scancel) on the Dagster host."""
    try:
        return subprocess.run(args, env=env, input=stdin, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise Failure(
            f"slurm launcher: '{args[0]}' is not on this host's PATH; install the Slurm client "
            "(`make slurm`) or run Dagster on a login node of the cluster",
            allow_retries=False,
        ) from None


def submit(script: str, env: dict[str, str]) -> str:
    """The job id. The script goes on sbatch's stdin (no file the cluster would have to see); secrets
    reach the job, if at all, through sbatch's environment, never the script."""
    proc = slurm_cli(["sbatch", "--parsable"], env=env, stdin=script)
    if proc.returncode != 0:
        raise Failure(
            f"sbatch refused the job script: {proc.stderr.strip()}; fix the launcher's slurm config "
            "(partition, account, qos, extra_sbatch) or the cluster",
            allow_retries=False,
        )
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
    raise Failure(
        f"Slurm job {job_id}: scontrol does not know it ({proc.stderr.strip()}) and sacct has no record "
        f"({acct.stderr.strip()}); enable accounting or raise MinJobAge in slurm.conf so that the "
        "launcher can read how jobs end"
    )


def follow(
    context: AssetExecutionContext,
    job_id: str,
    output: JobOutput,
    poll_seconds: float,
    frozen: Callable[[], str | None],
) -> str:
    """Wait for the job's final state, streaming its output; stop when the Dagster run is terminated, or with
    `Frozen` when the job's heartbeats stopped (`frozen`: the launching side's watch)."""
    while True:
        state = job_state(job_id)
        output.stream(context)
        if job_outcome(state) is not None:
            output.stream(context)  # the batch step ships its last chunk before it ends
            return state
        reason = frozen()
        if reason:
            raise Frozen(reason)
        run = context.instance.get_run_by_id(context.run_id)
        if run is not None and run.status in (DagsterRunStatus.CANCELING, DagsterRunStatus.CANCELED):
            raise Failure(
                f"Dagster run {context.run_id} was terminated; Slurm job {job_id} is cancelled and not "
                "retried; materialize the stage again to resume from its newest checkpoint",
                allow_retries=False,
            )
        time.sleep(poll_seconds)


def follow_or_cancel(
    context: AssetExecutionContext,
    job_id: str,
    output: JobOutput,
    poll_seconds: float,
    frozen: Callable[[], str | None],
) -> str:
    """Follow the job; if following stops for any reason (interrupt, termination, error, a frozen job), the job
    must not run on unwatched, holding nodes and writing to the run."""
    try:
        return follow(context, job_id, output, poll_seconds, frozen)
    except BaseException:
        proc = slurm_cli(["scancel", job_id])
        context.log.warning(f"scancel {job_id}: " + ("done" if proc.returncode == 0 else proc.stderr.strip()))
        raise


def end(home: Home, target: Job, job_id: str, state: str, output_uri: str) -> None:
    """Map the job's final state: ok needs the run's record; a resumable end asks for a retry; a failed
    one does not (a bug or OOM would recur, a cancel was meant): re-materialize once it is fixed."""
    outcome = job_outcome(state)
    if outcome == "resumable":
        raise Failure(
            f"{target.stage} run {target.run_key}: Slurm job {job_id} ended {state}; a retry or "
            "re-materialization with the same config resumes the run from its newest checkpoint",
            allow_retries=True,
        )
    if outcome == "failed":
        raise failure(
            home,
            target,
            f"Slurm job {job_id} ended {state}; its output is in the store at {output_uri}",
            allow_retries=False,
            cancelled=state.startswith("CANCELLED"),
        )
    require_result(home, target)

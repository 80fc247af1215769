"""The `local` launcher: torchrun on the machine that runs Dagster, through Dagster Pipes."""

from __future__ import annotations

from dagster import AssetExecutionContext

from ghostvis_core.home import Home
from ghostvis_core.launch.cluster.torchrun_command import node_grace_s, torchrun_command
from ghostvis_core.runs.job_command import Job
from ghostvis_pipeline.launchers.common import attempt_name, failure, frozen_watch, require_result, spec_uri
from ghostvis_pipeline.launchers.pipes import job_session
from ghostvis_pipeline.launchers.processes import Frozen, start, stop, wait


def run_local(context: AssetExecutionContext, target: Job, home: Home, launcher) -> None:
    nproc = launcher.ranks_per_node(target)
    cmd = torchrun_command(
        spec_uri(home, target), nproc, module=target.module, args=target.args, grace_s=target.runtime.preempt_grace_s
    )
    context.log.info(f"launching: {' '.join(cmd)}")
    with job_session(context, home, target, attempt_name(context), launcher, nproc) as env:
        job = {"torchrun": start(cmd, env)}
        try:
            failed = wait(job, frozen_watch(home, target))
        except Frozen as exc:  # nothing of the job can stop itself: killed now, retried by the stage
            stop(job, grace_s=0)
            raise failure(home, target, str(exc)) from None
        finally:  # the Dagster run terminated: torchrun and its ranks stop before the interrupt goes on up
            stop(job, grace_s=node_grace_s(target.runtime.preempt_grace_s))
    if failed:
        raise failure(home, target, f"torchrun exited with code {failed[1]}")
    require_result(home, target)

"""The `local` launcher: torchrun on the machine that runs Dagster, through Dagster Pipes."""

from __future__ import annotations

from dagster import AssetExecutionContext

from ghostvis_core.home import Home
from ghostvis_core.launch.cluster.torchrun import torchrun_command
from ghostvis_core.run.job import Job
from ghostvis_pipeline.launchers.common import attempt_name, failure, require_result, spec_uri
from ghostvis_pipeline.launchers.pipes import job_session
from ghostvis_pipeline.launchers.processes import start, stop, wait


def run_local(context: AssetExecutionContext, target: Job, home: Home, launcher) -> None:
    nproc = launcher.ranks_per_node(target)
    cmd = torchrun_command(spec_uri(home, target), nproc, module=target.module, args=target.args)
    context.log.info(f"launching: {' '.join(cmd)}")
    with job_session(context, home, target, attempt_name(context), launcher, nproc) as env:
        job = {"torchrun": start(cmd, env)}
        try:
            failed = wait(job)
        finally:  # the Dagster run terminated: torchrun and its ranks stop before the interrupt goes on up
            stop(job)
    if failed:
        raise failure(home, target, f"torchrun exited with code {failed[1]}")
    require_result(home, target)

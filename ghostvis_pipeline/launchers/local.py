"""The `local` launcher: torchrun on the machine that runs Dagster, through Dagster Pipes."""

from __future__ import annotations

from dagster import AssetExecutionContext, PipesSubprocessClient

from ghostvis_core.cluster.torchrun import torchrun_command
from ghostvis_core.home import Home
from ghostvis_core.train.spec import LaunchSpec
from ghostvis_pipeline.launchers.common import clear_reason, failure, job_env, require_result, spec_uri


def run_local(context: AssetExecutionContext, spec: LaunchSpec, home: Home, launcher) -> None:
    nproc = launcher.ranks_per_node(spec)
    cmd = torchrun_command(spec_uri(home, spec), nproc)
    context.log.info(f"launching: {' '.join(cmd)}")
    clear_reason(home, spec)
    client = PipesSubprocessClient(env=job_env(launcher.profile, nproc))
    try:
        client.run(command=cmd, context=context)
    except Exception as exc:
        raise failure(home, spec, str(exc)) from None
    require_result(home, spec)

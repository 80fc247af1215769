"""The `torchrun` launcher: multi-node torchrun with a c10d rendezvous on machines started by hand or
by another scheduler. The Dagster host is one of the nodes; the others are started through
`node_shell` (e.g. `ssh {host}`) when `hosts` are listed, or by whoever reads the logged command
(also in the store, run_file torchrun/nodes.sh: `ghostvis store cat <its logged URI> | sh` runs it on a node
that shares nothing with the Dagster host but the store). Rank 0 may land on any node, so every node gets the
Pipes variables and the messages travel through the shared store."""

from __future__ import annotations

import shlex
import subprocess

from dagster import AssetExecutionContext, Failure

from ghostvis_core.errors import GhostvisError
from ghostvis_core.home import Home
from ghostvis_core.launch.cluster.torchrun_command import MultiNode, node_grace_s, node_line, torchrun_command
from ghostvis_core.runs.job_command import Job
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
from ghostvis_pipeline.launchers.processes import Frozen, start, stop, wait

MultiNodeConfig = config_from_dataclass(MultiNode)


def run_torchrun(context: AssetExecutionContext, target: Job, home: Home, launcher) -> None:
    multi = MultiNode(**launcher.torchrun.model_dump())
    try:
        multi.check()
    except GhostvisError as exc:
        raise Failure(str(exc), allow_retries=False) from None
    nproc = launcher.ranks_per_node(target)
    attempt = attempt_name(context)
    rdzv = multi.rendezvous(target.run_key, attempt)
    cmd = torchrun_command(
        spec_uri(home, target),
        nproc,
        rdzv,
        module=target.module,
        args=target.args,
        grace_s=target.runtime.preempt_grace_s,
    )
    with job_session(context, home, target, attempt, launcher, nproc, multi.cpus_per_node or None) as env:
        line = node_line(cmd, env)
        script_uri = home.store.write_text(
            "run_file",
            target.stage,
            target.run_key,
            "torchrun/nodes.sh",
            text=(f"#!/bin/sh\n# {target.run_key}: run on each of the {multi.nnodes - 1} other node(s)\n{line}\n"),
        )
        context.log.info(
            f"rendezvous {rdzv.endpoint} id {rdzv.rdzv_id}, {multi.nnodes} nodes x {nproc} rank(s); "
            f"this node: {' '.join(cmd)}; the other nodes' command: {script_uri} (run it on a node "
            f"with `ghostvis store cat {script_uri} | sh`)"
        )
        nodes = {"this node": start(cmd, env)}
        try:
            _start_others(context, multi, line, script_uri, nodes, host_environment(launcher.send_credentials))
            failed = wait(nodes, frozen_watch(home, target))
        except Frozen as exc:  # nothing of the job can stop itself: killed now, retried by the stage
            stop(nodes, grace_s=0)
            raise failure(home, target, str(exc)) from None
        finally:  # a failed node, or the Dagster run terminated (its interrupt goes on up once all are stopped)
            stop(nodes, grace_s=node_grace_s(target.runtime.preempt_grace_s))
    if failed:
        raise failure(home, target, f"{failed[0]} exited with code {failed[1]}")
    require_result(home, target)


def _start_others(
    context: AssetExecutionContext,
    multi: MultiNode,
    line: str,
    script: str,
    nodes: dict[str, subprocess.Popen],
    shell_env: dict[str, str],
) -> None:
    """Start the other nodes through node_shell (into `nodes`) with `shell_env` (a node shell such as
    `srun` may pass it on), or tell the user how to start them (`script`: the URI of nodes.sh in the store)."""
    if not multi.hosts:
        context.log.info(
            f"start the {multi.nnodes - 1} other node(s) now, each with "
            f"`ghostvis store cat {script} | sh` or this command:\n{line}"
        )
    for i, host in enumerate(multi.hosts):
        argv = multi.node_argv(host, line)
        context.log.info(f"node {host}: {shlex.join(argv[:-1])} '<the command in {script}>'")
        try:
            nodes[f"hosts[{i}] {host}"] = start(argv, {}, shell_env)  # a host may be listed twice
        except OSError as exc:
            raise Failure(
                f"torchrun launcher: node_shell '{multi.node_shell}' could not start on {host} ({exc}); "
                "install its program on the Dagster host or fix launcher torchrun.node_shell",
                allow_retries=False,
            ) from None

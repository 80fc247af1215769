"""`ghostvis plan --mtbf-hours H`: the planned run's expected goodput under failures and the checkpoint interval
to choose (ghostvis_core/plan/goodput.py), from flags or from the figures a completed run measured."""

from __future__ import annotations

import argparse

from ghostvis_core.errors import GhostvisError
from ghostvis_core.home import Home
from ghostvis_core.plan.budget import Plan
from ghostvis_core.plan.config import StageConfig
from ghostvis_core.plan.goodput import FailureFigures, GoodputPlan, plan_goodput
from ghostvis_core.runs.lookup import newest_completed_run

# GPUs per node when --gpus-per-node is not given: an 8-GPU server (HGX/DGX H100), printed as an assumption.
ASSUMED_GPUS_PER_NODE = 8


def add_goodput_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--mtbf-hours",
        type=float,
        help="mean time between failures of one node, hours: print the expected goodput under failures and the "
        "checkpoint interval to choose (job MTBF = this / nodes; needs a step time: --step-time or --gpu)",
    )
    p.add_argument(
        "--gpus-per-node",
        type=int,
        help=f"GPUs per node, for the nodes of --world-size (default: {ASSUMED_GPUS_PER_NODE}, an assumption)",
    )
    p.add_argument("--save-seconds", type=float, help="seconds a checkpoint save stops training (with --mtbf-hours)")
    p.add_argument(
        "--restart-seconds",
        type=float,
        help="seconds from a failure to the first step after the checkpoint is loaded (with --mtbf-hours; "
        "default: the time to the first step measured by the stage's newest completed run)",
    )


def measured_restart(stage: str) -> tuple[float, str] | None:
    """(seconds, where from): the stage's newest completed run's launch-to-first-step time (start-up, the
    checkpoint load on a resumed segment, the first step), from its run record; None without one."""
    home = Home.from_env()
    if not home.root.exists():
        return None
    run = newest_completed_run(home.store, stage)
    if run is None:
        return None
    return run.first_step_s, f"measured: first_step_s of {stage} run {run.run_key}, segment {run.segment}"


def goodput_figures(args) -> FailureFigures:
    """The failure figures of --mtbf-hours and where each comes from; refused when one is missing."""
    if args.save_seconds is None:
        raise GhostvisError(
            "--mtbf-hours needs the checkpoint save time: run records do not measure it; pass --save-seconds S "
            "(the seconds a checkpoint save stops training)"
        )
    restart = (args.restart_seconds, "given: --restart-seconds") if args.restart_seconds is not None else None
    restart = restart or measured_restart(args.stage)
    if restart is None:
        raise GhostvisError(
            f"--mtbf-hours needs the restart time: GHOSTVIS_HOME has no completed {args.stage} run to measure it "
            f"from; pass --restart-seconds S (failure to the first step after the checkpoint is loaded)"
        )
    per_node = args.gpus_per_node or ASSUMED_GPUS_PER_NODE
    for flag, value, positive in [
        ("--mtbf-hours", args.mtbf_hours, True),
        ("--gpus-per-node", per_node, True),
        ("--save-seconds", args.save_seconds, False),
        ("--restart-seconds", restart[0], False),
    ]:
        if value < 0 or (positive and value == 0):
            raise GhostvisError(f"{flag} {value:g}: the goodput plan needs {'above' if positive else 'at least'} 0")
    assumed = f"assumed: {ASSUMED_GPUS_PER_NODE} per node"
    return FailureFigures(
        node_mtbf_hours=args.mtbf_hours,
        gpus_per_node=per_node,
        save_s=args.save_seconds,
        restart_s=restart[0],
        gpus_per_node_from="given: --gpus-per-node" if args.gpus_per_node else assumed,
        save_from="given: --save-seconds",
        restart_from=restart[1],
    )


def goodput_plan(args, cfg: StageConfig, p: Plan) -> GoodputPlan | None:
    """The goodput plan of `p` with --mtbf-hours, else None."""
    if args.mtbf_hours is None:
        return None
    if p.step_time_s is None:
        raise GhostvisError("--mtbf-hours needs a step time: pass --step-time S (measured) or --gpu (and --mfu)")
    ck = cfg.checkpoint
    return plan_goodput(
        goodput_figures(args), p.batch.world_size, p.steps, p.step_time_s, ck.every_steps, ck.every_minutes
    )

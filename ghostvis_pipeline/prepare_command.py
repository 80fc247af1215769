"""`ghostvis prepare <stage>`: plan a stage run on this host and print the torchrun line that trains it.

The job only runs specs (`python -m ghostvis_core.run --spec URI`), so planning a run by hand happens here, on
the launching side, as the pipeline's launchers do: the stage is resolved, its launch spec saved in the store,
and the line printed on stdout (the run key and the spec's URI on stderr). Run the line on any machine that
reaches the store; a second `prepare` of the same stage resumes the newest unfinished attempt.
"""

from __future__ import annotations

import shlex
import sys

from ghostvis_core.home import Home
from ghostvis_core.launch.cluster.torchrun_command import torchrun_command
from ghostvis_core.plan import selected
from ghostvis_core.plan.config import parse_sets
from ghostvis_core.plan.stages import stage_names
from ghostvis_pipeline.subcommand import subcommand


def torchrun_line(spec_uri: str, ranks: int, grace_s: float) -> list[str]:
    """The launchers' one-node torchrun command for a training spec, as a user types it (`torchrun ...`)."""
    python_m_torchrun = 3  # `<python> -m <AGENT_MODULE>`: torchrun, which the torchrun script runs
    return ["torchrun", *torchrun_command(spec_uri, ranks, grace_s=grace_s)[python_m_torchrun:]]


def cmd_prepare(args) -> int:
    from ghostvis_core.launch.start import prepare_run

    home = Home.from_env()
    spec = prepare_run(args.stage, home=home, preset=args.preset, overrides=parse_sets(args.sets))
    uri = home.store.uri_of("run_spec", spec.stage, spec.run_key)
    print(f"{spec.stage}: run {spec.run_key}, launch spec {uri}", file=sys.stderr, flush=True)
    print(shlex.join(torchrun_line(uri, spec.config.batch.world_size, spec.config.runtime.preempt_grace_s)))
    return 0


def add_parser(sub) -> None:
    p = subcommand(
        sub,
        "prepare",
        help="plan a stage run here (its launch spec in the store) and print the torchrun line that trains it",
        fn=cmd_prepare,
    )
    p.add_argument("stage", choices=stage_names())
    p.add_argument(
        "--preset", default=selected.default_preset(), help="preset name (default: GHOSTVIS_PRESET, else tiny)"
    )
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a dotted config override, e.g. --set budget.steps=50 (repeatable)",
    )

"""`ghostvis goodput [--run KEY | --stage NAME | --lineage] [--json]`: where a run's wall time went, from the
ledger (ghostvis_core/data/ledger/goodput.py): productive steps against redone steps, start-up, checkpoint load and
save, evaluation, waiting and detection, with goodput = productive / wall and the token slots trained once against
those computed and thrown away. A stage means its newest completed run; --lineage (the default) every stage of the
selected lineage that has one."""

from __future__ import annotations

import json

from ghostvis_core.data.ledger.goodput import CATEGORIES, KILLED, Goodput
from ghostvis_core.errors import GhostvisError
from ghostvis_core.home import Home
from ghostvis_pipeline.subcommand import subcommand


def stage_goodput(home: Home, stage: str) -> Goodput | None:
    """The goodput of the stage's newest completed run, or None when it has none or its launches kept no timeline."""
    from ghostvis_core.data.ledger import Ledger
    from ghostvis_core.data.ledger.goodput import ledger_goodput
    from ghostvis_core.runs.lookup import newest_completed_run

    run = newest_completed_run(home.store, stage)
    return ledger_goodput(Ledger.in_store(home.store), run.run_key) if run else None


def cmd_goodput(args) -> int:
    from ghostvis_core.data.ledger import Ledger
    from ghostvis_core.data.ledger.goodput import ledger_goodput
    from ghostvis_core.plan import selected

    home = Home.from_env()
    if args.run:
        found = ledger_goodput(Ledger.in_store(home.store), args.run)
        if found is None:
            raise GhostvisError(
                f"run {args.run}: no launch of it recorded a timeline in the ledger (a run trained before timelines "
                "were recorded, or a key that names no run: `ghostvis ledger` lists the runs)"
            )
        results = [found]
    else:
        stages = [args.stage] if args.stage else selected.lineage().stage_names()
        results = [g for g in (stage_goodput(home, s) for s in stages) if g is not None]
        if args.stage and not results:
            raise GhostvisError(
                f"stage {args.stage}: no completed run with a timeline in the ledger; materialize the `{args.stage}` "
                "asset first"
            )
    if args.json:
        print(json.dumps([g.as_dict() for g in results], indent=2))
        return 0
    print("\n\n".join("\n".join(goodput_lines(g)) for g in results) or "no completed run has a timeline yet")
    return 0


def goodput_lines(g: Goodput) -> list[str]:
    """A run's goodput as text: the headline, then one line per category with its share of the wall."""
    lines = [
        f"{g.stage} run {g.run_key}: goodput {g.goodput:.1%} of {g.wall_s:,.1f} s wall over {g.launches} launch(es)",
    ]
    notes = {
        "productive": f"{g.productive_steps} steps kept, {g.tokens_once:,} token slots trained once",
        "redone": f"{g.redone_steps} steps not kept, {g.tokens_thrown_away:,} token slots thrown away",
    }
    for k in CATEGORIES:
        share = g.seconds[k] / g.wall_s if g.wall_s > 0 else 0.0
        note = f"  ({notes[k]})" if k in notes else ""
        lines.append(f"  {k:<16} {g.seconds[k]:>10,.1f} s {share:>7.1%}{note}")
    for f in g.faults:
        told = (
            f"  launch {f.launch} ({f.reason}) cost {f.seconds:,.1f} s and {f.steps} steps ({f.tokens:,} token slots)"
        )
        if f.reason == KILLED:
            told += (
                f"; {f.unrecorded_s:,.1f} s of it unrecorded (the steps it computed after its last commit are unknown)"
            )
        lines.append(told)
    if g.unmeasured_gaps:
        lines.append(f"  ({g.unmeasured_gaps} gap(s) between launches on different hosts' clocks: not measured)")
    return lines


def add_parser(sub) -> None:
    p = subcommand(
        sub,
        "goodput",
        help="where a run's wall time went: kept steps, redone steps, start-up, saves, waits",
        fn=cmd_goodput,
        json=True,
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument("--run", metavar="RUN_KEY", help="one run")
    which.add_argument("--stage", metavar="NAME", help="the stage's newest completed run")
    which.add_argument("--lineage", action="store_true", help="each stage of the lineage (the default)")

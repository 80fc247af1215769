"""`ghostvis train <stage>`: materialize one training stage on your own sources, with the recipe
given on the command line, through the same Dagster asset (and checks) as the UI and `dagster`."""

from __future__ import annotations

import argparse

from ghostvis_core.home import Home
from ghostvis_core.plan import selected
from ghostvis_core.plan.config import parse_sets
from ghostvis_core.plan.presets import parse_recipe
from ghostvis_core.plan.stages import stage_names
from ghostvis_pipeline.subcommand import subcommand


def stage_run_config(args) -> dict:
    """The stage asset's run config (StageRunConfig) from the command's flags."""
    config = {
        "overrides": parse_sets(args.sets),
        "recipe": parse_recipe(args.recipe) if args.recipe else {},
        "val_sources": [s for s in (args.val_sources or "").split(",") if s],
        "force": args.force,
        "wait": not args.no_wait,
    }
    if args.preset:
        config["preset"] = args.preset
    return {"ops": {args.stage: {"config": config}}}


def cmd_train(args) -> int:
    from dagster import DagsterInstance

    from ghostvis_pipeline.definitions import defs
    from ghostvis_pipeline.demo import format_summary, materialize
    from ghostvis_pipeline.environment import prepare_environment
    from ghostvis_pipeline.metadata import newest_metadata

    selected.lineage().require(args.stage)  # the code location holds only the lineage's stages
    home = Home.from_env()
    prepare_environment(home)
    instance = DagsterInstance.get()
    summary = materialize(defs, instance, [args.stage], run_config=stage_run_config(args))
    print(format_summary([summary], sum(summary.assets.values())))
    md = newest_metadata(instance, args.stage)  # this run's materialization
    print(f"{args.stage}: run {md['run_key']}, checkpoint {md['checkpoint_uri']}")
    if "cached_from" in md:
        print(f"cached: {md['cached_from']['why']} (--force trains anyway)")
    if "reward_signal" in md:  # rl: no completion was rewarded, so the run learned nothing
        print(f"warning: {md['reward_signal']}")
    return 0 if all(passed for *_, passed in summary.checks) else 1


def add_parser(sub) -> None:
    t = subcommand(
        sub,
        "train",
        help="materialize one training stage (its asset and checks), e.g. on your own sources",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Runs the stage's Dagster asset in this process, recorded in DAGSTER_HOME like a UI "
        "run. The stage it starts from in the lineage (GHOSTVIS_LINEAGE; none for the first stage) and the "
        "token ledger must be materialized.",
        fn=cmd_train,
    )
    t.add_argument("stage", choices=stage_names())
    t.add_argument("--preset", help="preset name (default: GHOSTVIS_PRESET, else tiny)")
    t.add_argument(
        "--recipe",
        help="source=weight,... of registered sources (default: the preset's recipe, or "
        "every registered source of the stage's kind by its tokens)",
    )
    t.add_argument(
        "--val-sources",
        help="comma-separated validation sources (default: the recipe's sources that have validation shards)",
    )
    t.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a dotted config override, e.g. --set budget.steps=200 (repeatable)",
    )
    t.add_argument(
        "--force",
        action="store_true",
        help="train even when a completed run of the same identity passed its checks (a new attempt)",
    )
    t.add_argument(
        "--no-wait",
        action="store_true",
        help="when another launch is training the same run identity now (it holds the run's lease), fail at once "
        "naming it, instead of waiting for it and returning its run as a cache hit",
    )

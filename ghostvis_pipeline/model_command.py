"""`ghostvis verify-model DIR [--store URI]` (is an exported model's training manifest and card consistent,
and with the store, true: ghostvis_core/run/hf/verify_model.py) and `ghostvis summary --stage S` (the
training-content summary of a stage's model: ghostvis_core/run/hf/summary.py, with summary.yaml)."""

from __future__ import annotations

import json
from pathlib import Path

from ghostvis_core.errors import GhostvisError
from ghostvis_core.home import Home
from ghostvis_core.plan.stages import stage_names
from ghostvis_pipeline.subcommand import subcommand


def cmd_verify_model(args) -> int:
    from ghostvis_core.run.hf.verify_model import read_manifest, verify_model
    from ghostvis_core.store import open_store

    folder = Path(args.dir)
    found = verify_model(folder, open_store(args.store) if args.store else None)
    if found:
        print(f"{folder}: {found}")
        return 1
    manifest, digest = read_manifest(folder)
    against = f"; every figure, Merkle root and token file matches the store {args.store}" if args.store else ""
    print(f"{folder}: consistent (manifest sha256 {digest}, {len(manifest['stages'])} stages){against}")
    return 0


def summary_path(args) -> Path:
    from ghostvis_core.run.hf.summary_input import SUMMARY_FILE

    return Path(args.summary) if args.summary else Home.from_env().root / SUMMARY_FILE


def cmd_summary(args) -> int:
    from ghostvis_core.data.ledger import Ledger
    from ghostvis_core.run.hf.manifest import build_manifest
    from ghostvis_core.run.hf.summary import build_summary, render_markdown
    from ghostvis_core.run.hf.summary_input import read_declared
    from ghostvis_core.runs.lookup import newest_completed_run

    store = Home.from_env().store
    run_key = args.run_key
    if run_key is None:
        newest = newest_completed_run(store, args.stage)
        if newest is None:
            raise GhostvisError(f"stage {args.stage} has no completed run; materialize the `{args.stage}` asset")
        run_key = newest.run_key
    declared = read_declared(summary_path(args), required=args.summary is not None)
    summary = build_summary(build_manifest(store, Ledger.in_store(store), args.stage, run_key), declared)
    print(
        json.dumps(summary, indent=2) if args.format == "json" else render_markdown(summary),
        end="\n" if args.format == "json" else "",
    )
    return 0


def add_parser(sub) -> None:
    v = subcommand(
        sub,
        "verify-model",
        help="check an exported model's training manifest and card (with --store: against the ledger)",
        fn=cmd_verify_model,
    )
    v.add_argument("dir", help="the exported model's folder (ghostvis_manifest.json, README.md)")
    v.add_argument("--store", help="the artifact store's URI: recompute every figure and root from its ledger")
    s = subcommand(
        sub, "summary", help="the public summary of a stage's training content (from the ledger)", fn=cmd_summary
    )
    s.add_argument("--stage", required=True, choices=stage_names())
    s.add_argument("--run-key", help="the run (default: the stage's newest completed run)")
    s.add_argument("--format", choices=("md", "json"), default="md")
    s.add_argument("--summary", help="the provider's declarations (default: $GHOSTVIS_HOME/summary.yaml)")

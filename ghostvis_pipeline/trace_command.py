"""`ghostvis trace`: where a document went (every stage, run, step and rank that trained it, the runs
and registered models downstream) and what one step fed (ghostvis_core/verify/trace.py); with
`--model DIR`, whether a document is in an exported model, per stage of its training manifest, with
inclusion proofs checked against the manifest alone (ghostvis_core/verify/model_trace.py)."""

from __future__ import annotations

import json

from ghostvis_core.errors import GhostvisError
from ghostvis_core.home import Home
from ghostvis_core.plan.stages import stage_names
from ghostvis_pipeline.subcommand import subcommand


def cmd_trace(args) -> int:
    from ghostvis_core.data.ledger import Ledger
    from ghostvis_core.verify.trace import find_text, shard_row, trace_document, trace_step

    home = Home.from_env()
    ledger = Ledger.in_store(home.store)
    uri = None if args.no_models else home.mlflow_tracking_uri
    if args.model:
        if not args.doc:
            raise GhostvisError("ghostvis trace --model DIR: give the document too, --doc <shard>:<row>")
        report = model_trace(home.store, ledger, args.doc, args.model)
        print(json.dumps(report, indent=2) if args.json else "\n".join(format_model_trace(report)))
        return 0
    if args.doc:
        report = trace_document(home.store, ledger, *shard_row(args.doc), uri)
        print(json.dumps(report, indent=2) if args.json else "\n".join(format_document(report)))
        return 0
    if args.text:
        found = find_text(home.store, ledger, args.text)
        reports = [trace_document(home.store, ledger, d["shard_id"], d["row"], uri) for d in found]
        if args.json:
            print(json.dumps({"found": found, "traces": reports}, indent=2))
            return 0
        print(f"found in {len(found)} document(s)" if found else "found in no document of the ledger")
        for d, report in zip(found, reports):
            print(f"\n{d['split']} document {d['shard_id']}:{d['row']}: {d['shared']} of {d['of']} fingerprints")
            print("\n".join(format_document(report)))
        return 0
    if not (args.stage and args.step):
        raise GhostvisError('ghostvis trace: give --doc <shard>:<row>, --text "...", or --stage <stage> --step <n>')
    report = trace_step(home.store, ledger, args.stage, args.step, args.run_key)
    print(json.dumps(report, indent=2) if args.json else "\n".join(format_step(report)))
    return 0


def model_trace(store, ledger, doc: str, model_dir: str) -> dict:
    """Whether the document is in the exported model at `model_dir`, per stage of its manifest, each proof
    checked against the manifest alone (`check`: None when it holds)."""
    from pathlib import Path

    from ghostvis_core.run.hf.inclusion import check_proof
    from ghostvis_core.run.hf.verify_model import read_manifest
    from ghostvis_core.verify.model_trace import document_proofs
    from ghostvis_core.verify.trace import shard_row

    manifest, digest = read_manifest(Path(model_dir))
    report = document_proofs(store, ledger, manifest, *shard_row(doc))
    for s in report["stages"]:
        s["check"] = check_proof(manifest, s["proof"]) if s["proof"] else None
    return {**report, "manifest_sha256": digest}


def format_model_trace(r: dict) -> list[str]:
    d = r["document"]
    out = [
        f"{d['shard_id']} row {d['row']}: {d['text']!r}",
        f"model {r['model']['stage']} ({r['model']['run_key']}), manifest sha256 {r['manifest_sha256']}",
    ]
    for s in r["stages"]:
        if not s["trained"]:
            out.append(f"{s['stage']:<20} no")
            continue
        p = s["proof"]
        told = "proof checks against the manifest" if s["check"] is None else f"proof FAILS: {s['check']}"
        out.append(
            f"{s['stage']:<20} yes: {s['fed_rows']} fed row(s); step {p['step']} rank {p['rank']} micro-batch "
            f"{p['micro_batch']} row {p['global_row']}, leaf {p['leaf_index']} of {p['tree_size']}: {told}"
        )
    return out


def format_document(r: dict) -> list[str]:
    d = r["document"]
    out = [f"{d['shard_id']} row {d['row']}: {d['text']!r}"]
    if not r["trained_by"]:
        out.append("trained by: no run (never consumed, or a validation document)")
    else:
        out.append(
            f"{'stage':<20} {'run_key':<34} {'seg':>3} {'epoch':>5} {'step':>6} {'rank':>4} {'micro':>5} {'row':>7}"
        )
        for h in r["trained_by"]:
            out.append(
                f"{h['stage']:<20} {h['run_key']:<34} {h['segment']:>3} {h['epoch']:>5} {h['step']:>6} "
                f"{h['rank']:>4} {h['micro_batch']:>5} {h['global_row']:>7}"
            )
    out.append("downstream runs: " + (", ".join(x["run_key"] for x in r["downstream_runs"]) or "none"))
    if r["registered_models"] is not None:
        models = [f"{m['model']} v{m['version']} ({m['run_key']})" for m in r["registered_models"]]
        out.append("registered models: " + (", ".join(models) or "none"))
    return out


def format_step(r: dict) -> list[str]:
    out = [f"{r['stage']} run {r['run_key']} step {r['step']}:"]
    out.append(f"{'rank':>4} {'micro':>5} {'row':>7} {'shard':<24} {'epoch':>5} {'raw rows':>13}  text")
    for f in r["fed"]:
        rows = f"{f['raw_rows'][0]}-{f['raw_rows'][1] - 1}"
        out.append(
            f"{f['rank']:>4} {f['micro_batch']:>5} {f['global_row']:>7} {f['shard_id']:<24} {f['epoch']:>5} "
            f"{rows:>13}  {f['text']!r}"
        )
    return out


def add_parser(sub) -> None:
    t = subcommand(
        sub, "trace", help="where a document went (--doc), or what a step fed (--stage --step)", fn=cmd_trace, json=True
    )
    t.add_argument("--doc", help="<shard>:<row>: the stages, runs, steps and ranks that trained this raw row")
    t.add_argument("--text", help="20 words or more of a document: found by its fingerprints, then traced as --doc")
    t.add_argument("--stage", choices=stage_names(), help="with --step: the documents that step fed")
    t.add_argument("--step", type=int)
    t.add_argument("--run-key", help="with --stage: the run (default: the stage's newest completed run)")
    t.add_argument("--model", help="with --doc: an exported model's folder: is the document in it, with proofs")
    t.add_argument("--no-models", action="store_true", help="with --doc or --text: skip the MLflow model registry")

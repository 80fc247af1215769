"""`ghostvis audit`: every data and stage invariant re-run from the artifact store and the MLflow store
alone (Dagster metadata is compared too when the caller passes it), one table per stage.

A stage's table puts the trainer's figures (its run record) next to the ledger's, MLflow's, the Dagster
metadata's and the recount from the token files; below it every check's verdict. The report's
`failures` name the stage (or `data`), the check and the figure or range that disagrees.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from ghostvis_core.counts import MLFLOW_METRICS, TokenCounts
from ghostvis_core.data.bpe_tokenizer import newest_tokenizer
from ghostvis_core.data.ledger import Ledger
from ghostvis_core.errors import GhostvisError
from ghostvis_core.home import Home
from ghostvis_core.run.track.mlflow_records import latest_metrics
from ghostvis_core.runs.lookup import newest_completed_run
from ghostvis_core.verify.audit import invariants as inv
from ghostvis_core.verify.audit.check_outcome import CheckOutcome
from ghostvis_core.verify.audit.data_checks import DATA_CHECKS
from ghostvis_core.verify.audit.stage_checks import STAGE_CHECKS, CheckInputs


def data_checks(home: Home, ledger: Ledger) -> list[CheckOutcome]:
    """The token ledger's checks (DATA_CHECKS), for the store's newest tokenizer."""
    tokenizer_id = newest_tokenizer(home.store)
    return [
        _guarded(name, lambda check=check: check(home.store, ledger, tokenizer_id)) for name, _, check in DATA_CHECKS
    ]


def stage_checks(inputs: CheckInputs) -> list[CheckOutcome]:
    """Every stage check of one run, in the order the Dagster asset checks list them."""
    return [_guarded(name, lambda check=check: check(inputs)) for name, _, check in STAGE_CHECKS]


def _guarded(name: str, check: Callable[[], CheckOutcome]) -> CheckOutcome:
    """A check that cannot read what it compares fails with the reason, instead of ending the audit."""
    try:
        return check()
    except GhostvisError as exc:
        return CheckOutcome(name, False, failures=[str(exc)])


def figure_table(
    ledger: Ledger,
    run: inv.StageRun,
    mlflow: dict[str, float],
    metadata: dict[str, Any] | None,
    recounted: CheckOutcome,
) -> list[list[Any]]:
    """Per figure: trainer (run record), ledger, MLflow, Dagster metadata, recount from the files."""
    ledger_counts = ledger.run_counts(run.spec.run_key).as_dict()
    rows = []
    for k in TokenCounts.names():
        vals = [
            getattr(run.record.counts, k),
            ledger_counts[k],
            mlflow.get(MLFLOW_METRICS[k]),
            None if metadata is None else metadata.get(k),
            recounted.figures.get(f"{k}_recount"),
        ]
        vals = [None if v is None else int(v) for v in vals]
        compared = [v for i, v in enumerate(vals) if not (i == 3 and metadata is None)]
        rows.append(
            [
                k,
                *["-" if v is None else v for v in vals],
                "ok" if None not in compared and len(set(compared)) == 1 else "MISMATCH",
            ]
        )
    return rows


def audit_stage(
    home: Home, ledger: Ledger, stage: str, run_key: str, metadata: dict[str, Any] | None
) -> dict[str, Any]:
    run = inv.StageRun.load(home.store, ledger, stage, run_key)
    try:
        mlflow = latest_metrics(home.mlflow_tracking_uri, run.record.mlflow_run_id)
    except Exception as exc:  # MLflow's client raises its own types; the audit names the store and goes on
        mlflow = {}
        print(
            f"audit: MLflow run {run.record.mlflow_run_id} not readable at {home.mlflow_tracking_uri}: {exc}",
            file=sys.stderr,
        )
    outcomes = stage_checks(CheckInputs(home, ledger, run, metadata, mlflow))
    return {
        "stage": stage,
        "run_key": run_key,
        "passed": all(o.passed for o in outcomes),
        "figures": figure_table(ledger, run, mlflow, metadata, outcomes[0]),
        "checks": [o.to_dict() for o in outcomes],
    }


def newest_run_key(home: Home, stage: str, metadata: dict[str, Any] | None) -> str | None:
    """The run the Dagster metadata names, else the stage's newest completed run, else None."""
    if metadata and metadata.get("run_key"):
        return str(metadata["run_key"])
    newest = newest_completed_run(home.store, stage)
    return newest.run_key if newest else None


def audit(home: Home, stages: list[str], metadata: dict[str, dict[str, Any]], required: bool) -> dict[str, Any]:
    """The data checks and every check of each stage's newest run. A stage without a completed run is
    a failure only when `required` (the user named it)."""
    ledger = Ledger.in_store(home.store)
    data = data_checks(home, ledger)
    report: dict[str, Any] = {"data": [o.to_dict() for o in data], "stages": [], "skipped": []}
    failures = [f"data: {o.name}: {f}" for o in data for f in o.failures]
    for stage in stages:
        run_key = newest_run_key(home, stage, metadata.get(stage))
        if run_key is None:
            report["skipped"].append(stage)
            failures += [f"{stage}: no completed run; materialize the `{stage}` asset"] if required else []
            continue
        result = audit_stage(home, ledger, stage, run_key, metadata.get(stage))
        report["stages"].append(result)
        failures += [
            f"{stage}: {c['name']}: {f}"
            for c in result["checks"]
            for f in c["failures"] or ([] if c["passed"] else ["failed"])
        ]
    report["failures"] = failures
    return report


def format_report(report: dict[str, Any]) -> list[str]:
    """The audit as text: the data checks, then per stage its figure table and its checks."""
    lines = ["data"] + [f"  {'ok  ' if c['passed'] else 'FAIL'} {c['name']}" for c in report["data"]]
    for s in report["stages"]:
        lines += [
            "",
            f"{s['stage']}  {s['run_key']}",
            f"  {'figure':<16} {'trainer':>12} {'ledger':>12} {'mlflow':>12} {'metadata':>12} {'recount':>12}",
        ]
        lines += [
            f"  {r[0]:<16} " + " ".join(f"{v:>12,}" if isinstance(v, int) else f"{v:>12}" for v in r[1:6]) + f"  {r[6]}"
            for r in s["figures"]
        ]
        lines += [
            f"  {'ok  ' if c['passed'] else 'FAIL'} {c['name']}"
            + (f": {c['figures']['summary']}" if "summary" in c["figures"] else "")
            for c in s["checks"]
        ]
    if report["skipped"]:
        lines += ["", f"no completed run: {', '.join(report['skipped'])}"]
    lines += ["", f"{len(report['failures'])} disagreement(s)" if report["failures"] else "every figure agrees"]
    lines += [f"  {f}" for f in report["failures"]]
    return lines

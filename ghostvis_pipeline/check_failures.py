"""Failed blocking checks, read from the Dagster instance's event log: as GhostVis's own message when one
stopped a command's run (each failure line as `ghostvis audit` prints it, `<asset>: <check>: <what
disagrees>`), and as the verdict `ghostvis ledger` shows beside each training run.

Dagster raises an error naming only the checks; what they found is in the checks' evaluations (the
`failures` metadata, one Markdown item a line), recorded in the run's event log."""

from __future__ import annotations

from collections.abc import Iterator

from ghostvis_core.errors import GhostvisError


def blocking_evaluations(instance, run_id: str) -> Iterator:
    """The blocking checks' evaluations in a Dagster run (each an AssetCheckEvaluation)."""
    from dagster import DagsterEventType

    for entry in instance.all_logs(run_id, of_type=DagsterEventType.ASSET_CHECK_EVALUATION):
        evaluation = entry.dagster_event.event_specific_data
        if evaluation.blocking:
            yield evaluation


def failed_check_lines(instance, run_id: str) -> list[str]:
    """Every failed blocking check of the run, one line per failure it names (`asset: check: failure`)."""
    lines = []
    for evaluation in blocking_evaluations(instance, run_id):
        if evaluation.passed:
            continue
        where = f"{evaluation.asset_key.to_user_string()}: {evaluation.check_name}"
        failures = evaluation.metadata.get("failures")
        items = [line.removeprefix("- ") for line in failures.value.splitlines()] if failures else ["failed"]
        lines += [f"{where}: {item}" for item in items if item]
    return lines


def check_failure_error(lines: list[str], run_id: str) -> GhostvisError:
    """The error a command ends with when a blocking check stopped its run (`lines`: failed_check_lines)."""
    return GhostvisError(
        "a blocking check failed, so the assets after it were not materialized:\n"
        + "\n".join(f"  {line}" for line in lines)
        + "\n(every figure and table: `ghostvis audit`; the run's events: the Dagster UI, run "
        + run_id
        + ")"
    )


def run_verdicts(instance, stages: list[str]) -> dict[str, str]:
    """Per training run key of these stage assets: `passed` when every blocking check of each of its
    materializations passed, `FAILED: <checks>` when any failed (a later pass does not hide a failure,
    as for cache hits), `unchecked` when no blocking check ran on it."""
    from dagster import AssetKey

    from ghostvis_pipeline.metadata import materializations

    failed: dict[str, set[str]] = {}
    checked: set[str] = set()
    for stage in stages:
        for rec in materializations(instance, AssetKey(stage)):
            run_key = getattr(rec.event_log_entry.asset_materialization.metadata.get("run_key"), "value", None)
            if run_key is None:
                continue
            failed.setdefault(run_key, set())
            for evaluation in blocking_evaluations(instance, rec.run_id):
                if evaluation.asset_key == AssetKey(stage):
                    checked.add(run_key)
                    if not evaluation.passed:
                        failed[run_key].add(evaluation.check_name)
    return {
        key: f"FAILED: {', '.join(sorted(names))}" if names else "passed" if key in checked else "unchecked"
        for key, names in failed.items()
    }

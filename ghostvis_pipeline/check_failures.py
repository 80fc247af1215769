"""A Dagster run stopped by a failed blocking check, as GhostVis's own message: each failed check's failure
lines as `ghostvis audit` prints them (`<asset>: <check>: <what disagrees>`), then how to see every figure.

Dagster raises an error naming only the checks; what they found is in the checks'
evaluations (the `failures` metadata, one Markdown item a line), recorded in the run's event log."""

from __future__ import annotations

from ghostvis_core.errors import GhostvisError


def failed_check_lines(instance, run_id: str) -> list[str]:
    """Every failed blocking check of the run, one line per failure it names (`asset: check: failure`)."""
    lines = []
    for entry in instance.all_logs(run_id):
        ev = entry.dagster_event
        if ev is None or ev.event_type_value != "ASSET_CHECK_EVALUATION":
            continue
        evaluation = ev.event_specific_data
        if evaluation.passed or not evaluation.blocking:
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

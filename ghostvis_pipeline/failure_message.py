"""GhostVis's own message as the last word of a failed Dagster run on the console (`dagster asset
materialize`, `dagster dev`'s run workers, the runs `ghostvis` commands start).

Dagster's console logger prints a failed step and the failed run with the error's stack trace. For a GhostVis
failure that trace says nothing the message does not: a Failure our code raised with the message as its
description, a GhostvisError (bad input: what failed, the figures, the fix), or a blocking check that failed
(its failure lines are what to read, as `ghostvis audit` prints them). So the project's dagster.yaml installs
FailureMessages as a Python log handler of the instance (`python_logs: dagster_handler_config`). Dagster hands
each record of a run to the instance's handlers (the event log's first, so it stores the record untouched,
stack traces included) before its console logger prints the same record: this handler rewrites that text.
- A failed step shows its message in place of the trace.
- The failed run ends with every failed step's message and every failed blocking check's lines. The run's own
  lines are printed after the steps' captured output, which Dagster mirrors to the console with `tail -F` and
  can cut short under load (dagster-io/dagster#23336): the end is where the message is sure to be seen.
GHOSTVIS_DEBUG=1 keeps Dagster's traces on the console (the run's summary still comes last). A failure that is
none of these (a bug) keeps its trace: then the trace is the message."""

from __future__ import annotations

import logging
import os

from dagster import DagsterEventType, DagsterInstance

from ghostvis_core.errors import DEBUG_ENV, GhostvisError
from ghostvis_pipeline.check_failures import check_failure_error, failed_check_lines

# Dagster's error when a blocking check fails; its message names the checks, their evaluations say what they found.
CHECK_FAILED = "DagsterAssetCheckFailedError"


def ghostvis_error_names() -> set[str]:
    """The class names of GhostvisError and of every subclass of it defined so far."""
    names, todo = set(), [GhostvisError]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo += cls.__subclasses__()
    return names


def error_text(error) -> str:
    """A SerializableErrorInfo's message without its `module.Class: ` prefix."""
    return error.message.strip().split(f"{error.cls_name}: ", 1)[-1]


def step_message(data) -> str | None:
    """GhostVis's message in a STEP_FAILURE's data: a Failure's description, a GhostvisError's text (Dagster
    wraps it as the cause of its own error), Dagster's list of failed blocking checks; None for anything else."""
    if data.user_failure_data is not None and data.user_failure_data.description:
        return data.user_failure_data.description
    ours, error = ghostvis_error_names(), data.error
    while error is not None:
        if error.cls_name in ours or error.cls_name == CHECK_FAILED:
            return error_text(error)
        error = error.cause
    return None


class FailureMessages(logging.Handler):
    """Rewrites, in place, the console text of a run's failed steps and of the failed run (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.debug = os.environ.get(DEBUG_ENV, "") not in ("", "0")

    def emit(self, record: logging.LogRecord) -> None:
        try:
            event = getattr(record, "dagster_meta", {}).get("dagster_event")
            kind = getattr(event, "event_type", None)
            if kind == DagsterEventType.STEP_FAILURE and not self.debug:
                message = step_message(event.event_specific_data)
                if message is not None:
                    record.msg = f"{headline(record)}\n\n{message}"
            elif kind == DagsterEventType.RUN_FAILURE and os.environ.get("DAGSTER_HOME"):
                with DagsterInstance.get() as instance:  # the instance whose dagster.yaml installed this handler
                    said = run_summary(instance, record.dagster_meta["run_id"])
                if said:
                    record.msg = f"{record.msg if self.debug else headline(record)}\n\n{said}"
        except Exception:  # logging's contract: report on stderr, never break the run that logs
            self.handleError(record)


def run_summary(instance, run_id: str) -> str:
    """Every failed step's GhostVis message in the run's event log, then its failed blocking checks' lines
    (a failed check's step by those lines alone); empty when the run failed otherwise."""
    steps = []
    for entry in instance.all_logs(run_id, of_type=DagsterEventType.STEP_FAILURE):
        data = entry.dagster_event.event_specific_data
        message = step_message(data)
        if message is not None and (data.error is None or data.error.cls_name != CHECK_FAILED):
            steps.append(f"{entry.step_key} failed: {message}")
    checks = failed_check_lines(instance, run_id)
    return "\n".join(steps + ([str(check_failure_error(checks, run_id))] if checks else []))


def headline(record: logging.LogRecord) -> str:
    """Dagster's line for the event, without the error and stack trace it appends after a blank line."""
    return str(record.msg).split("\n\n", 1)[0]

"""GhostVis's own message as the last word of a failed asset step, for `dagster asset materialize` and the UI.

Dagster logs a failed step with its exception and stack trace, then ends the command with "Materialization
failed." A GhostVis failure (a Failure whose description is the message, or a GhostvisError: what failed,
the figures, the fix) is said once more by this failure hook after that trace, alone, so the command's
output ends with what to do rather than with Dagster's frames. The trace stays in Dagster's log for
whoever needs it; `ghostvis` commands print the message alone (subcommand.py)."""

from __future__ import annotations

from dagster import Failure, HookContext, failure_hook

from ghostvis_core.errors import GhostvisError


def ghostvis_message(exc: BaseException | None) -> str | None:
    """The message of a GhostVis failure in `exc` or its causes (Dagster wraps a user exception); None
    for anything else (a bug: its trace is the message)."""
    while exc is not None:
        if isinstance(exc, Failure) and exc.description:
            return exc.description
        if isinstance(exc, GhostvisError):
            return str(exc)
        exc = exc.__cause__
    return None


@failure_hook(name="ghostvis_failure_message")
def say_failure(context: HookContext) -> None:
    message = ghostvis_message(context.op_exception)
    if message:
        context.log.error(f"{context.step_key} failed: {message}")

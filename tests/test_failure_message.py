"""The console of a failed Dagster run on an instance with the project's dagster.yaml (its `python_logs` handler,
ghostvis_pipeline/failure_message.py): a GhostVis failure (a Failure with its message, a GhostvisError, a failed
blocking check) is shown by its message, with no stack trace, and the run ends with the messages; a bug keeps
Dagster's trace; GHOSTVIS_DEBUG=1 keeps every trace; the event log keeps every trace whatever the console shows.
Real Dagster runs in this process, of a few assets made to fail."""

from __future__ import annotations

import pytest
from dagster import (
    AssetCheckResult,
    AssetKey,
    DagsterEventType,
    DagsterInstance,
    Definitions,
    Failure,
    MetadataValue,
    asset,
    asset_check,
)

from ghostvis_core.errors import GhostvisError
from ghostvis_pipeline.environment import PROJECT_DAGSTER_YAML

REFUSED = (
    "pre-flight failed: source web: the budget needs 49,153 tokens but 20,424 are available; set data.allow_repeat=true"
)
BAD_INPUT = (
    "shard web/00012: checksum mismatch (expected 1a2b, got 3c4d); re-materialize raw_shards partition web/00012"
)
CHECK_LINE = "ledger 39 docs, file 38; re-materialize tokenized_shards partition web/00001"


@asset
def refused():
    raise Failure(description=REFUSED, allow_retries=False)


@asset
def bad_input():
    raise GhostvisError(BAD_INPUT)


@asset
def bug():
    raise ZeroDivisionError("division by zero")


@asset
def counted():
    return 1


@asset_check(asset=counted, blocking=True)
def recounted() -> AssetCheckResult:
    return AssetCheckResult(passed=False, metadata={"failures": MetadataValue.md(f"- {CHECK_LINE}")})


DEFS = Definitions(assets=[refused, bad_input, bug, counted], asset_checks=[recounted])


# Captured output off: Dagster mirrors a step's captured output to the console with `tail -F`, which can drop
# the last lines under load (dagster-io/dagster#23336), a step's failure line among them; the run's own lines,
# the last one included, are printed after the capture and always reach the console.
NO_CAPTURE = """
compute_logs:
  module: dagster._core.storage.noop_compute_log_manager
  class: NoOpComputeLogManager
"""


@pytest.fixture(scope="module")
def instance(tmp_path_factory):
    """A Dagster instance whose dagster.yaml is the project's (without captured output), shared by this file's
    runs (each its own run id)."""
    home = tmp_path_factory.mktemp("dagster")
    (home / "dagster.yaml").write_text(PROJECT_DAGSTER_YAML.read_text() + NO_CAPTURE)
    with pytest.MonkeyPatch.context() as patches:
        patches.setenv("DAGSTER_HOME", str(home))
        patches.delenv("GHOSTVIS_DEBUG", raising=False)
        with DagsterInstance.get() as instance:
            yield instance


def failed_run(instance, asset_name: str, capfd) -> tuple[str, str]:
    """Materialize one asset (and its checks), which fails: (its run id, what the console printed)."""
    capfd.readouterr()
    job = DEFS.resolve_implicit_job_def_def_for_assets([AssetKey(asset_name)])
    result = job.execute_in_process(instance=instance, asset_selection=[AssetKey(asset_name)], raise_on_error=False)
    assert not result.success
    return result.run_id, capfd.readouterr().err


def stored_error(instance, run_id: str):
    (entry,) = instance.all_logs(run_id, of_type=DagsterEventType.STEP_FAILURE)
    return entry.dagster_event.event_specific_data.error


@pytest.mark.parametrize(("name", "message"), [("refused", REFUSED), ("bad_input", BAD_INPUT)])
def test_a_ghostvis_failure_is_its_message_on_the_console_and_its_trace_in_the_event_log(
    instance, capfd, name, message
):  # noqa: E501
    run_id, console = failed_run(instance, name, capfd)
    assert "Stack Trace" not in console and "Traceback" not in console and 'File "' not in console
    assert f'STEP_FAILURE - Execution of step "{name}" failed.\n\n{message}\n' in console
    assert console.rstrip("\n").endswith(f"Steps failed: ['{name}'].\n\n{name} failed: {message}")
    error = stored_error(instance, run_id)
    assert message in error.to_string() and "Stack Trace:" in error.to_string() and error.stack


def test_a_failed_blocking_check_ends_the_run_with_its_lines(instance, capfd):
    run_id, console = failed_run(instance, "counted", capfd)
    assert "Stack Trace" not in console
    assert console.rstrip("\n").endswith(
        "a blocking check failed, so the assets after it were not materialized:\n"
        f"  counted: recounted: {CHECK_LINE}\n"
        f"(every figure and table: `ghostvis audit`; the run's events: the Dagster UI, run {run_id})"
    )


def test_a_bug_keeps_its_trace(instance, capfd):
    run_id, console = failed_run(instance, "bug", capfd)
    assert "ZeroDivisionError: division by zero" in console and "Stack Trace:" in console
    assert console.rstrip("\n").splitlines()[-1].strip() == 'raise ZeroDivisionError("division by zero")'


def test_ghostvis_debug_keeps_the_trace_and_still_ends_with_the_message(instance, capfd, monkeypatch):
    monkeypatch.setenv("GHOSTVIS_DEBUG", "1")
    run_id, console = failed_run(instance, "bad_input", capfd)
    assert "Stack Trace:" in console and "The above exception was caused by the following exception" in console
    assert console.rstrip("\n").endswith(f"\n\nbad_input failed: {BAD_INPUT}")

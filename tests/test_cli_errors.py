"""A `ghostvis` command ends a failure with GhostVis's message, not a traceback: a failed blocking check
with its failure lines as `ghostvis audit` prints them (asset: check: what disagrees); bad input with its
fix; the traceback only with --debug. `ghostvis ledger` marks a run whose blocking checks failed."""

from __future__ import annotations

import pytest
from dagster import (
    AssetCheckResult,
    DagsterInstance,
    Definitions,
    MaterializeResult,
    MetadataValue,
    asset,
    asset_check,
)

from ghostvis_core.errors import GhostvisError
from ghostvis_pipeline.check_failures import run_verdicts
from ghostvis_pipeline.cli import main
from ghostvis_pipeline.demo import materialize

FAILURES = ["document in my_chats/00003 row 3 and my_chats/00002 row 8", "same content: a/1, a/2"]


@asset
def ledger_like() -> int:
    return 1


@asset_check(asset="ledger_like", blocking=True)
def no_duplicates() -> AssetCheckResult:
    return AssetCheckResult(
        passed=False, metadata={"failures": MetadataValue.md("\n".join(f"- {f}" for f in FAILURES))}
    )


@asset_check(asset="ledger_like", blocking=False)
def advisory() -> AssetCheckResult:
    return AssetCheckResult(passed=False, metadata={"failures": MetadataValue.md("- not blocking")})


@asset(deps=["ledger_like"])
def after() -> int:
    return 2


DEFS = Definitions(assets=[ledger_like, after], asset_checks=[no_duplicates, advisory])


def test_a_failed_blocking_check_is_a_message_with_its_failure_lines():
    with DagsterInstance.ephemeral() as instance, pytest.raises(GhostvisError) as err:
        materialize(DEFS, instance, ["ledger_like", "after"])
    lines = str(err.value).splitlines()
    assert lines[0] == "a blocking check failed, so the assets after it were not materialized:"
    assert lines[1:3] == [f"  ledger_like: no_duplicates: {f}" for f in FAILURES]
    assert "not blocking" not in str(err.value)
    assert lines[3].startswith("(every figure and table: `ghostvis audit`")


def test_bad_input_is_one_message_and_debug_shows_the_traceback(capsys):
    assert main(["plan", "--steps", "10", "--tokens", "1000"]) == 2
    err = capsys.readouterr().err
    assert err == "ghostvis: error: give one of --steps, --tokens, --tokens-per-param, --hours (got steps, tokens)\n"
    with pytest.raises(GhostvisError, match="give one of --steps"):
        main(["plan", "--steps", "10", "--tokens", "1000", "--debug"])


@asset
def sft() -> MaterializeResult:
    return MaterializeResult(metadata={"run_key": "sft-0123456789-r1"})


@asset_check(asset="sft", blocking=True)
def no_eval_contamination() -> AssetCheckResult:
    return AssetCheckResult(passed=False, metadata={"failures": MetadataValue.md("- overlap 0.40 > 0.20")})


@asset_check(asset="sft", blocking=False)
def evidence() -> AssetCheckResult:
    return AssetCheckResult(passed=False)


@asset
def dpo() -> MaterializeResult:
    return MaterializeResult(metadata={"run_key": "dpo-0123456789-r1"})


@asset_check(asset="dpo", blocking=True)
def consumed_equals_planned() -> AssetCheckResult:
    return AssetCheckResult(passed=True)


@asset
def rl() -> MaterializeResult:
    return MaterializeResult(metadata={"run_key": "rl-0123456789-r1"})


STAGES = Definitions(assets=[sft, dpo, rl], asset_checks=[no_eval_contamination, evidence, consumed_equals_planned])


def test_the_ledgers_verdict_marks_a_run_whose_blocking_check_failed():
    with DagsterInstance.ephemeral() as instance:
        with pytest.raises(GhostvisError, match="sft: no_eval_contamination: overlap 0.40 > 0.20"):
            materialize(STAGES, instance, ["sft"])
        materialize(STAGES, instance, ["dpo", "rl"])
        assert run_verdicts(instance, ["sft", "dpo", "rl"]) == {
            "sft-0123456789-r1": "FAILED: no_eval_contamination",  # the non-blocking one's failure is not named
            "dpo-0123456789-r1": "passed",
            "rl-0123456789-r1": "unchecked",
        }

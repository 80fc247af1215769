"""Whether a stage run's blocking checks passed, kept beside the run and shown in MLflow.

The training job registers the run's model before Dagster has checked the run (the checks read what the
job left), so a version starts `pending`: tagged `ghostvis.checks=pending`, with no alias. Each blocking
check of the run records its outcome as the run file `checks/<check>.json` ({"check", "passed",
"failures", "of": every blocking check of the stage, "dagster_run_id"}); the run's verdict is `failed`
as soon as one recorded check failed, `passed` once every one of them recorded a pass, else `pending`.

In MLflow the verdict is the version's and the run's `ghostvis.checks` tag; `passed` moves the stage's
alias to the version, `failed` takes the alias off it (if it was there) and ends the MLflow run FAILED.
So `models:/ghostvis@<stage>` only ever names a version whose checks passed, and a failed run's version
stays in the registry, tagged, for a look at what it learned."""

from __future__ import annotations

from dataclasses import dataclass

PENDING, PASSED, FAILED = "pending", "passed", "failed"
CHECKS_TAG = "ghostvis.checks"  # on the model version and on the stage's MLflow run
CHECKS_FOLDER = "checks"  # run files checks/<check>.json


@dataclass(frozen=True)
class Verdict:
    state: str  # PENDING, PASSED or FAILED
    failed: tuple[str, ...]  # the checks that failed
    missing: tuple[str, ...]  # the checks not recorded yet


def record_check(
    store, stage: str, run_key: str, check: str, passed: bool, failures: list[str], of: list[str], dagster_run_id: str
) -> tuple[Verdict, Verdict]:
    """Keep one check's outcome for the run (a later outcome of the same check replaces it: a re-check after
    a fix counts); the run's verdict before and after it."""
    records = _records(store, stage, run_key)
    record = {
        "check": check,
        "passed": passed,
        "failures": failures,
        "of": sorted(of),
        "dagster_run_id": dagster_run_id,
    }
    store.write_json("run_file", stage, run_key, f"{CHECKS_FOLDER}/{check}.json", data=record)
    after = [r for r in records if r["check"] != check] + [record]
    return _verdict(records), _verdict(after)


def run_verdict(store, stage: str, run_key: str) -> Verdict:
    """The run's verdict from its recorded checks (no record: pending, nothing known)."""
    return _verdict(_records(store, stage, run_key))


def _records(store, stage: str, run_key: str) -> list[dict]:
    return [store.read_json("run_file", *key) for key in store.keys("run_file", stage, run_key) if _is_check(key[-1])]


def _verdict(records: list[dict]) -> Verdict:
    if not records:
        return Verdict(PENDING, (), ())
    expected = set().union(*(r["of"] for r in records))
    failed = tuple(sorted(r["check"] for r in records if not r["passed"]))
    missing = tuple(sorted(expected - {r["check"] for r in records}))
    state = FAILED if failed else PENDING if missing else PASSED
    return Verdict(state, failed, missing)


def _is_check(name: str) -> bool:
    return name.startswith(f"{CHECKS_FOLDER}/") and name.endswith(".json")


def mark_in_registry(client, registered_name: str, stage: str, version: int, run_id: str, verdict: Verdict) -> None:
    """Show the verdict in MLflow (`client`: an MlflowClient): the version's and the run's tag, the stage's
    alias on the version only when it passed, the run's status FAILED when it failed (else FINISHED)."""
    client.set_model_version_tag(registered_name, str(version), CHECKS_TAG, verdict.state)
    client.set_tag(run_id, CHECKS_TAG, verdict.state)
    if verdict.state == PASSED:
        client.set_registered_model_alias(registered_name, stage, str(version))
    elif verdict.state == FAILED:
        aliased = client.get_registered_model(registered_name).aliases.get(stage)
        if aliased is not None and int(aliased) == version:
            client.delete_registered_model_alias(registered_name, stage)
    _set_status(client, run_id, "FAILED" if verdict.state == FAILED else "FINISHED")


def _set_status(client, run_id: str, status: str) -> None:
    """The run's status, its end time kept (a FAILED run that passes a re-check is FINISHED again)."""
    info = client.get_run(run_id).info
    if info.status != status and info.status in ("FINISHED", "FAILED"):  # a run still running is its job's
        client.set_terminated(run_id, status, end_time=info.end_time)

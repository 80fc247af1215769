"""A run's blocking checks decide its registry entry: recorded beside the run, each check's outcome makes the
run's verdict (failed at the first failure, passed once every check passed, else pending), and the verdict
reaches a real MLflow registry (sqlite): a version registered before its checks is pending with no alias, a
failed one is tagged failed with no alias and its run FAILED, a passed one gets the stage's alias."""

from __future__ import annotations

import pytest

from ghostvis_core.run.track.check_verdict import (
    CHECKS_TAG,
    FAILED,
    PASSED,
    PENDING,
    Verdict,
    mark_in_registry,
    record_check,
    run_verdict,
)
from ghostvis_core.store.folder import FolderStore

CHECKS = ["consumption_matches_plan", "no_eval_contamination", "tokens_match_plan"]
MODEL = "ghostvis"


def test_the_verdict_is_failed_at_the_first_failure_and_passed_only_once_every_check_passed(tmp_path):
    store = FolderStore(tmp_path / "store")
    assert run_verdict(store, "sft", "sft-a-r1") == Verdict(PENDING, (), ())  # nothing recorded yet
    before, first = record_check(store, "sft", "sft-a-r1", CHECKS[0], True, [], CHECKS, "dagster-1")
    assert (before, first) == (Verdict(PENDING, (), ()), Verdict(PENDING, (), tuple(CHECKS[1:])))
    overlap = ["my_chats/00001 row 3 shares 0.40 of its 13-grams with validation item 7 (max 0.20)"]
    _, failed = record_check(store, "sft", "sft-a-r1", CHECKS[1], False, overlap, CHECKS, "dagster-1")
    assert failed == Verdict(FAILED, (CHECKS[1],), (CHECKS[2],)) == run_verdict(store, "sft", "sft-a-r1")
    assert store.read_json("run_file", "sft", "sft-a-r1", f"checks/{CHECKS[1]}.json") == {
        "check": CHECKS[1],
        "passed": False,
        "failures": overlap,
        "of": CHECKS,
        "dagster_run_id": "dagster-1",
    }
    assert record_check(store, "sft", "sft-a-r1", CHECKS[2], True, [], CHECKS, "dagster-1")[1].state == FAILED
    # a re-check after the fix replaces the check's outcome: every check passed
    before, after = record_check(store, "sft", "sft-a-r1", CHECKS[1], True, [], CHECKS, "dagster-2")
    assert (before.state, after) == (FAILED, Verdict(PASSED, (), ()))
    assert run_verdict(store, "sft", "sft-b-r1").state == PENDING  # another run's checks are its own


@pytest.fixture
def registry(tmp_path):
    """A sqlite MLflow with two finished sft runs, each registered as a version of `ghostvis`."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("ghostvis", artifact_location=(tmp_path / "art").as_uri())
    client.create_registered_model(MODEL)
    runs = []
    for _ in range(2):
        run = client.create_run(experiment)
        client.set_terminated(run.info.run_id, "FINISHED")
        client.create_model_version(MODEL, (tmp_path / "art" / "m").as_uri(), run_id=run.info.run_id)
        runs.append(run.info.run_id)
    return client, runs


def test_the_registry_gives_the_alias_only_to_a_version_whose_checks_passed(registry):
    client, (run1, run2) = registry
    end = client.get_run(run1).info.end_time
    mark_in_registry(client, MODEL, "sft", 1, run1, Verdict(PENDING, (), tuple(CHECKS)))  # as the job registers it
    assert marked_as(client, 1, run1, "sft") == (PENDING, PENDING, "FINISHED", None)
    mark_in_registry(client, MODEL, "sft", 1, run1, Verdict(FAILED, (CHECKS[1],), ()))
    assert marked_as(client, 1, run1, "sft") == (FAILED, FAILED, "FAILED", None)
    assert client.get_run(run1).info.end_time == end  # the run's end is when it trained, not when it was checked
    mark_in_registry(client, MODEL, "sft", 2, run2, Verdict(PASSED, (), ()))
    assert marked_as(client, 2, run2, "sft") == (PASSED, PASSED, "FINISHED", 2)
    # version 2 fails a re-check: its alias is taken off, version 1 (failed) does not get it back
    mark_in_registry(client, MODEL, "sft", 2, run2, Verdict(FAILED, (CHECKS[0],), ()))
    assert marked_as(client, 2, run2, "sft") == (FAILED, FAILED, "FAILED", None)
    # and passes after the fix: the alias is back, the run FINISHED again
    mark_in_registry(client, MODEL, "sft", 2, run2, Verdict(PASSED, (), ()))
    assert marked_as(client, 2, run2, "sft") == (PASSED, PASSED, "FINISHED", 2)
    mark_in_registry(client, MODEL, "sft", 1, run1, Verdict(FAILED, (CHECKS[1],), ()))
    assert marked_as(client, 2, run2, "sft")[3] == 2  # a failed version leaves another version's alias alone


def run_checks(home, stage: str, names: list[str]):
    """`names` of the stage's blocking checks, run by Dagster in this process against the home (as the
    checks_only job does, for one stage): their evaluations, and the messages the run logged."""
    from dagster import AssetCheckKey, AssetKey, AssetSelection, DagsterInstance, Definitions, define_asset_job

    from ghostvis_pipeline.definitions import defs

    keys = [AssetCheckKey(AssetKey(stage), name) for name in names]
    job = define_asset_job("recheck", selection=AssetSelection.checks(*keys))
    with_job = Definitions(
        assets=defs.assets, asset_checks=defs.asset_checks, jobs=[job], resources=defs.resources, executor=defs.executor
    )
    env = {"GHOSTVIS_HOME": str(home), "DAGSTER_HOME": str(home / "dagster"), "GHOSTVIS_PRESET": "smoke"}
    with pytest.MonkeyPatch.context() as patches:
        for k, v in env.items():
            patches.setenv(k, v)
        patches.delenv("MLFLOW_TRACKING_URI", raising=False)
        with DagsterInstance.get() as instance:
            result = with_job.resolve_job_def("recheck").execute_in_process(instance=instance, raise_on_error=False)
            logged = [entry.user_message for entry in instance.all_logs(result.run_id)]
    return {e.check_name: e for e in result.get_asset_check_evaluations()}, logged


def commit_record(home, stage: str, run_key: str, text: str) -> None:
    """The run record rewritten under the run's lease (store/fence.py), as its trainer commits it."""
    from ghostvis_core.home import Home
    from ghostvis_core.runs.lookup import identity_of
    from ghostvis_core.store.fence import Fence
    from ghostvis_core.store.lease import newest_generation

    store = Home(home).store
    store.write_text("run_record", stage, run_key, text=text)
    held = newest_generation(store, stage, identity_of(run_key))
    Fence(store, stage, identity_of(run_key), held.number, held.holder).commit("run_record", stage, run_key, text=text)


@pytest.mark.e2e
def test_a_stage_check_failing_in_dagster_tags_the_version_failed_and_a_passing_recheck_gives_the_alias_back(
    home_copy,
):
    """The demo dpo's run record edited to count one real token more than its ledger, MLflow and metadata (a
    record its trainer committed wrong): dpo's ledger_mlflow_metadata_agree, run by Dagster, fails, and the
    check's failure line is in the store, the version is tagged failed, the alias is taken off it and its MLflow
    run is FAILED. The record put back, the check passes again: with every other check's outcome the demo's own
    materialization recorded (passed), the run is passed again, tagged so, FINISHED, and the alias is back on its
    version."""
    import json

    from mlflow.tracking import MlflowClient

    from ghostvis_core.home import Home
    from tests.test_e2e_demo import dagster_instance, latest

    check = "ledger_mlflow_metadata_agree"
    md = latest(dagster_instance(home_copy), "dpo")
    run_key, version, run_id = md["run_key"], md["mlflow_model_version"], md["mlflow_run_id"]
    h = Home(home_copy)
    client = MlflowClient(f"sqlite:///{home_copy / 'mlflow.db'}")
    assert client.get_registered_model(MODEL).aliases["dpo"] == version  # the demo registered it
    assert run_verdict(h.store, "dpo", run_key).state == PASSED  # the demo's checks recorded their outcomes
    original = h.store.read_text("run_record", "dpo", run_key)
    record = json.loads(original)
    real = record["counts"]["real_tokens"]
    record["counts"]["real_tokens"] += 1
    commit_record(home_copy, "dpo", run_key, json.dumps(record))

    evaluations, logged = run_checks(home_copy, "dpo", [check])
    assert not evaluations[check].passed
    failure = f"real_tokens: ledger {real}, mlflow {real}, run_record {real + 1}, metadata {real}"
    assert h.store.read_json("run_file", "dpo", run_key, f"checks/{check}.json")["failures"] == [failure]
    # the check's failure line as `ghostvis audit` prints it, in the run's log (Dagster's names only the check)
    assert f"dpo: {check}: {failure}\n(every figure and table: `ghostvis audit --stage dpo`)" in logged
    assert run_verdict(h.store, "dpo", run_key).state == FAILED
    assert marked_as(client, version, run_id, "dpo") == (FAILED, FAILED, "FAILED", None)

    commit_record(home_copy, "dpo", run_key, original)  # the fix
    assert run_checks(home_copy, "dpo", [check])[0][check].passed
    assert run_verdict(h.store, "dpo", run_key).state == PASSED
    assert marked_as(client, version, run_id, "dpo") == (PASSED, PASSED, "FINISHED", version)


def marked_as(client, version: int, run_id: str, stage: str) -> tuple[str, str, str, int | None]:
    """(version tag, run tag, run status, the version the stage's alias names)."""
    run = client.get_run(run_id)
    return (
        client.get_model_version(MODEL, str(version)).tags[CHECKS_TAG],
        run.data.tags[CHECKS_TAG],
        run.info.status,
        client.get_registered_model(MODEL).aliases.get(stage),
    )

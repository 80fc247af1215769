"""Blocking checks that fail properly: each test gives a check the data it exists to refuse and asserts
the outcome's message, so a failure path that crashes (a typed record read as a dict) is found here and
not on a user's refresh."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ghostvis_core.data.catalog import recorded_sha256, registered_manifests
from ghostvis_core.data.ledger import Ledger
from ghostvis_core.home import Home
from ghostvis_core.runs.lookup import completed_runs, identity_of
from ghostvis_core.store.fence import Fence
from ghostvis_core.store.files import sha256_file
from ghostvis_core.store.lease import newest_generation
from ghostvis_core.verify.audit import invariants as inv
from tests.conftest import run_cli
from tests.ledger_rows import shard_record
from tests.test_bad_inputs import TEXTS, run_manifest, write_parquet
from tests.test_errors import MATERIALIZE


def newest_check_evaluation(home: Path, check: str):
    """The evaluation of asset check `check` in the newest Dagster run of the home's instance."""
    from dagster import DagsterEventType, DagsterInstance

    with DagsterInstance.from_config(str(home / "dagster")) as instance:
        [run] = instance.get_runs(limit=1)
        entries = instance.all_logs(run.run_id, of_type=DagsterEventType.ASSET_CHECK_EVALUATION)
    [evaluation] = [
        e.dagster_event.event_specific_data for e in entries if e.dagster_event.event_specific_data.check_name == check
    ]
    return evaluation


def test_two_shards_with_the_same_content_fail_no_duplicate_content_naming_both(tmp_path):
    """A shard's new version whose content equals another shard's: the check fails and names the pair."""
    ledger = Ledger(tmp_path / "ledger")
    ledger.write_shard(shard_record("demo_prose/00000", sha="a" * 64))
    ledger.write_shard(shard_record("demo_prose/00001", sha="b" * 64))
    ledger.write_shard(shard_record("demo_prose/00001", sha="a" * 64, created_at=2.0))  # its revision
    outcome = inv.no_duplicate_content(ledger, "tok-a")
    assert not outcome.passed
    assert outcome.figures == {"duplicate_shards": 1, "docs_in_train_and_validation": 0}
    assert outcome.failures == ["same content: demo_prose/00000, demo_prose/00001"]
    assert outcome.tables["duplicates"][1] == [["a" * 16, "demo_prose/00000, demo_prose/00001"]]


def test_a_manifest_shard_left_untokenized_fails_all_manifest_shards_tokenized_naming_it(tmp_path):
    """A source of two shards registered by the real shard_manifest asset, only one of them in the ledger."""
    home = tmp_path / "home"
    for name, texts in TEXTS.items():
        write_parquet(tmp_path / "listing" / f"{name}.parquet", {"text": texts})
    assert run_manifest(home, [{"name": "web", "listing": (tmp_path / "listing").as_uri()}]).success
    store = Home(home).store
    [manifest] = registered_manifests(store).values()
    ids = sorted(manifest.shard_id(e) for e in manifest.shards)
    assert len(ids) == 2
    ledger = Ledger.in_store(store)
    ledger.write_shard(shard_record(ids[0], source="web"))
    outcome = inv.all_manifest_shards_tokenized(store, ledger, "tok-a")
    assert not outcome.passed
    assert outcome.figures == {"manifest_shards": 2, "tokenized_shards": 1, "missing": ids[1]}
    assert outcome.failures == [f"shard {ids[1]} not tokenized"]
    assert inv.all_manifest_shards_tokenized(store, ledger, "tok-b").failures == [
        f"shard {i} not tokenized" for i in ids
    ]  # another tokenizer's shards do not count


@pytest.mark.e2e
def test_a_run_record_planning_more_tokens_than_its_steps_trained_fails_tokens_match_plan(home_copy):
    """The demo pretrain's run record edited to plan ten steps more than it trained (a run recorded complete
    that stopped early): `ghostvis audit --no-dagster`, which reads the figures from the run record rather than
    the materialization's metadata, fails tokens_match_plan with both figures."""
    h = Home(home_copy)
    run_key = completed_runs(h.store, "pretrain")[-1].run_key
    path = home_copy / "store" / "checkpoints" / "pretrain" / run_key / "RUN_COMPLETE.json"
    record = json.loads(path.read_text())
    trained = record["steps"] * record["batch"]["tokens_per_step"]
    record["planned_tokens"] = trained + 10 * record["batch"]["tokens_per_step"]
    path.write_text(json.dumps(record))
    # the trainer that wrote it commits it under the run's lease (store/fence.py), as a real one would
    identity = identity_of(run_key)
    held = newest_generation(h.store, "pretrain", identity)
    Fence(h.store, "pretrain", identity, held.number, held.holder).commit(
        "run_record", "pretrain", run_key, text=path.read_text()
    )
    proc = run_cli(["ghostvis", "audit", "--stage", "pretrain", "--no-dagster"], home_copy, check=False)
    assert proc.returncode == 1
    assert (
        f"pretrain: tokens_match_plan: steps x tokens_per_step {trained:,} not within one step of planned "
        f"{record['planned_tokens']:,}"
    ) in proc.stdout


@pytest.mark.e2e
def test_a_rollout_record_counting_one_token_more_than_its_completions_fails_rollouts_recounted(home_copy):
    """The demo rl run's first rollout record (one rank's step) edited to record one generated token more than
    its saved completions hold: `ghostvis audit` names the step, the rank and both figures."""
    h = Home(home_copy)
    run_key = completed_runs(h.store, "rl")[-1].run_key
    path = sorted((home_copy / "store" / "ledger" / "rollouts" / "stage=rl" / f"run={run_key}").glob("*.parquet"))[0]
    table = pq.read_table(path)
    rows = table.to_pylist()
    first = rows[0]
    generated = sum(len(ids) for ids in json.loads(first["completion_ids"]))
    assert first["generated_tokens"] == generated > 0
    first["generated_tokens"] = generated + 1
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), path)
    proc = run_cli(["ghostvis", "audit", "--stage", "rl", "--no-dagster"], home_copy, check=False)
    assert proc.returncode == 1
    assert (
        f"rl: rollouts_recounted: rl step {first['step']} rank {first['rank']}: generated_tokens recorded "
        f"{generated + 1:,}, recounted from the completions {generated:,}"
    ) in proc.stdout


@pytest.mark.e2e
def test_an_upstream_revision_equal_to_another_shard_fails_no_duplicate_content_in_dagster_and_the_audit(
    home_copy, tmp_path
):
    """demo_prose/00001 revised upstream (its manifest entry pins the new file's sha256) to the content of
    demo_prose/00000, then raw_shards, tokenized_shards and token_ledger for it, as a user refreshing data
    would: token_ledger's blocking check and `ghostvis audit` fail no_duplicate_content naming both shards
    (both crashed with TypeError on the typed DuplicateContent before)."""
    h = Home(home_copy)
    revised = tmp_path / "00001.parquet"
    shutil.copyfile(h.store.fetch("raw_shard", "demo_prose/00000"), revised)
    manifest = h.store.read_json("manifest", "demo_prose")
    [entry] = [e for e in manifest["shards"] if e["name"] == "00001"]
    entry.update(url=revised.as_uri(), bytes=revised.stat().st_size, sha256=sha256_file(revised))
    h.store.write_json("manifest", "demo_prose", data=manifest)
    for asset in ("raw_shards", "tokenized_shards"):
        run_cli([*MATERIALIZE, "--select", asset, "--partition", "demo_prose/00001"], home_copy)
    assert recorded_sha256(h.store, "demo_prose/00001") == recorded_sha256(h.store, "demo_prose/00000")
    ledger = run_cli([*MATERIALIZE, "--select", "token_ledger"], home_copy, check=False)
    said = ledger.stdout + ledger.stderr
    assert ledger.returncode != 0 and "Asset check 'no_duplicate_content' on 'token_ledger' did not pass" in said
    assert "TypeError" not in said
    evaluation = newest_check_evaluation(home_copy, "no_duplicate_content")
    assert not evaluation.passed
    assert evaluation.metadata["duplicate_shards"].value == 1
    assert evaluation.metadata["failures"].value == "- same content: demo_prose/00000, demo_prose/00001"
    proc = run_cli(["ghostvis", "audit", "--no-dagster"], home_copy, check=False)
    assert proc.returncode == 1
    assert "data: no_duplicate_content: same content: demo_prose/00000, demo_prose/00001" in proc.stdout

"""Bad input fails early with one message that names the thing and the fix (no traceback)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from dagster import DagsterEventType, DagsterInstance

from ghostvis_core.data.ledger import Ledger
from ghostvis_core.home import Home
from ghostvis_core.launch.cluster.torchrun_command import AGENT_MODULE
from ghostvis_core.plan.budget import batch_plan
from ghostvis_core.plan.presets import resolve
from ghostvis_pipeline.environment import PROJECT_DAGSTER_YAML
from tests.conftest import run_cli

MATERIALIZE = ["dagster", "asset", "materialize", "-m", "ghostvis_pipeline.definitions"]
# 5,000 steps of the smoke pretrain, half of them from each of its two sources: windows of 256 inputs, where
# consecutive windows share their boundary token (the last target of one is the first input of the next), so n
# windows read n x 256 + 1
SMOKE_ROWS_PER_STEP = batch_plan(resolve("pretrain", "smoke").batch).rows_per_step
NEEDED_PER_SOURCE = 5000 * SMOKE_ROWS_PER_STEP // 2 * 256 + 1


def test_unknown_preset(tmp_path):
    proc = run_cli(["ghostvis", "plan", "--preset", "nope"], tmp_path, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "ghostvis: error: unknown preset 'nope'; choose one of: tiny, smoke, 500m, 1.5b, 7b"


def test_total_batch_that_does_not_divide(tmp_path):
    proc = run_cli(["ghostvis", "plan", "--total-batch-tokens", "10000"], tmp_path, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert (
        "batch.total_batch_tokens=10000 is not divisible by micro_batch_size x seq_len x world_size = "
        "4 x 256 x 2 = 2048; choose a total that is a multiple of 2048"
    ) in proc.stderr


@pytest.mark.e2e
def test_missing_tokenized_shard_stops_the_stage_before_torchrun(home_copy):
    # this version's instance config (a home made before it keeps its own dagster.yaml: README)
    shutil.copy(PROJECT_DAGSTER_YAML, home_copy / "dagster" / "dagster.yaml")
    ledger = Ledger.in_store(Home(home_copy).store)
    path = Path(next(r.token_path for r in ledger.shards() if r.shard_id == "demo_code/00001"))
    path.unlink()
    proc = run_cli([*MATERIALIZE, "--select", "pretrain"], home_copy, check=False)
    assert proc.returncode != 0
    message = (
        f"tokenized shard demo_code/00001 ({path}) is in the ledger but missing on disk; "
        "re-materialize tokenized_shards partition demo_code/00001"
    )
    assert message in proc.stdout + proc.stderr
    assert AGENT_MODULE not in proc.stdout + proc.stderr
    # Dagster's console (the project's dagster.yaml, ghostvis_pipeline/failure_message.py): no stack trace, and
    # the failed run's last line of ours is the message with its fix, before the line Dagster's command ends with
    said = proc.stdout + proc.stderr
    assert "Traceback" not in said and "Stack Trace" not in said and 'File "' not in said
    assert proc.stderr.rstrip("\n").splitlines()[-3:] == [
        "",
        f"pretrain failed: {message}",
        "Error: Materialization failed.",
    ]
    # the run's event log keeps Dagster's whole error, stack trace included (the UI shows it)
    instance_dir = home_copy / "dagster"
    with DagsterInstance.from_config(str(instance_dir)) as instance:
        (run,) = instance.get_runs(limit=1)
        (failed,) = instance.all_logs(run.run_id, of_type=DagsterEventType.STEP_FAILURE)
    error = failed.dagster_event.event_specific_data.error
    assert error.cls_name == "Failure" and message in error.message and "_user_error" in "".join(error.stack)


@pytest.mark.e2e
def test_corrupt_parquet_fails_its_partition_and_leaves_the_others_done(home_copy):
    store = Home(home_copy).store
    bad = store.fetch("raw_shard", "demo_prose/00001")  # a folder store's own file, truncated below
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])  # truncated mid-file
    for f in store.fetch("ledger_file", "shards").glob("*.parquet"):  # forget the neighbours: they must be redone
        f.unlink()
    proc = run_cli(
        [*MATERIALIZE, "--select", "tokenized_shards", "--partition-range", "demo_prose/00000...demo_prose/00002"],
        home_copy,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "1 of 3 shards failed to tokenize (2 others are done and recorded; a re-run skips them)" in out
    # the worker checks the file it reads against the hash raw_shards recorded at download
    assert (
        f"raw shard demo_prose/00001 ({bad}): content changed since it was recorded (expected sha256 " in out
        and "re-materialize raw_shards partition demo_prose/00001" in out
    )
    done = {r.shard_id for r in Ledger.in_store(store).shards()}
    assert done == {"demo_prose/00000", "demo_prose/00002"}
    # the fix the message names: re-materialize the raw shard (its checksum no longer matches, so it
    # is downloaded again), then tokenizing the range only does the repaired shard
    run_cli([*MATERIALIZE, "--select", "raw_shards", "--partition", "demo_prose/00001"], home_copy)
    proc = run_cli(
        [*MATERIALIZE, "--select", "tokenized_shards", "--partition-range", "demo_prose/00000...demo_prose/00002"],
        home_copy,
    )
    assert "tokenized_shards: 3 shards (1 tokenized, 2 unchanged and skipped)" in proc.stdout + proc.stderr
    assert {r.shard_id for r in Ledger.in_store(store).shards()} == {
        "demo_prose/00000",
        "demo_prose/00001",
        "demo_prose/00002",
    }


@pytest.mark.e2e
def test_a_budget_beyond_the_data_fails_pre_flight_with_the_numbers(home_copy):
    """The known failure: 100 shards on disk when 178 were needed. The stage must not start, and
    the message says how many tokens are missing and about how many more shards to tokenize. The
    pre-flight is the job's (rank 0 calls check_run before the first step), here called as it does."""
    import math

    from ghostvis_core.errors import GhostvisError
    from ghostvis_core.launch.start import prepare_run
    from ghostvis_core.run.preflight import check_run
    from ghostvis_core.runs.launch_spec import LaunchSpec
    from ghostvis_core.runs.preflight_findings import preflight_record

    home = Home(home_copy)
    train = [r for r in Ledger.in_store(home.store).shards() if r.source == "demo_prose" and r.split == "train"]
    available = sum(r.tokens for r in train)
    needed = NEEDED_PER_SOURCE
    with pytest.raises(GhostvisError) as err:
        check_run(prepare_run("pretrain", preset="smoke", home=home, overrides={"budget.steps": "5000"}), home.store)
    msg = str(err.value)
    assert msg.startswith("pre-flight failed: ")
    epochs = needed / available
    more = math.ceil((needed - available) / (available / len(train)))
    assert (
        f"source demo_prose: the budget needs {needed:,} tokens but {available:,} are available in "
        f"{len(train)} tokenized shards ({epochs:.2f} epochs); tokenize about {more} more shards"
    ) in msg
    assert f"or set data.allow_repeat=true to repeat the data {epochs:.2f} times" in msg
    assert f"source demo_code: the budget needs {needed:,} tokens" in msg

    # declared repetition starts, and the epochs it will take are recorded with the run, in a record of their own:
    # the launch spec is written once, by the launch side, and the job's pre-flight leaves it as it was
    spec = prepare_run(
        "pretrain", preset="smoke", home=home, overrides={"budget.steps": "5000", "data.allow_repeat": "true"}
    )
    saved = Path(home.store.uri_of("run_spec", "pretrain", spec.run_key))
    before = (saved.read_bytes(), saved.stat().st_mtime_ns)
    found = check_run(spec, home.store)
    assert (saved.read_bytes(), saved.stat().st_mtime_ns) == before and LaunchSpec.from_dict(
        json.loads(before[0])
    ) == spec
    budget = found.source_budget["demo_prose"]
    assert (budget.needed_tokens, budget.available_tokens) == (needed, available)
    assert budget.epochs == round(epochs, 3) > 1
    assert preflight_record(home.store, "pretrain", spec.run_key) == found  # what the materialization shows


@pytest.mark.e2e
def test_the_jobs_pre_flight_refusal_fails_the_materialization_once_with_its_message(home_copy):
    """Through Dagster: the launch spec is written, the job's rank 0 refuses before the first step (the
    Dagster process never builds the objective), and the materialization fails with the pre-flight's
    message and the fix, without a retry (the same inputs would be refused again)."""
    from tests.conftest import materialize_pretrain

    argv = materialize_pretrain()
    argv[argv.index("--config-json") + 1] = json.dumps(
        {"ops": {"pretrain": {"config": {"preset": "smoke", "overrides": {"budget.steps": "5000"}}}}}
    )
    proc = run_cli(argv, home_copy, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    store = Home(home_copy).store
    records = [
        store.read_json("run_file", *key) for key in store.keys("run_file", "pretrain") if key[-1] == "preflight.json"
    ]
    (refused,) = [r["refused"] for r in records if "refused" in r]
    assert refused.startswith(f"pre-flight failed: source demo_prose: the budget needs {NEEDED_PER_SOURCE:,} tokens")
    assert f"; source demo_code: the budget needs {NEEDED_PER_SOURCE:,} tokens" in refused
    assert "tokenize about" in refused and "or set data.allow_repeat=true to repeat the data" in refused
    host = next(r["host"] for r in records if "refused" in r)
    assert f"rank 0 on {host}" in out and refused in out
    assert "STEP_UP_FOR_RETRY" not in out
    # torchrun's end is one line naming the rank (run/elastic_agent.py), and no trace reaches the console; both
    # ranks raise the broadcast refusal, so the first to end (torchrun's root cause) is either
    assert "Traceback" not in out and "ChildFailedError" not in out, out[-4000:]
    on_host = rf"pid \d+ on {re.escape(host)}\) ended with exit code 2;"  # a refusal's exit code
    ended = rf"torchrun: ghostvis_core\.run: rank ([01]) \(local rank \1, {on_host}"
    assert re.search(ended, out), out[-4000:]

"""MLflow as its users expect, against a real `mlflow server` on 127.0.0.1: every stage's model is one
version of the `ghostvis` registered model, with the stage's alias and the lineage in its tags (a
cache hit adds none); each stage run lists the shards it read as dataset inputs whose digests are
the ledger's content hashes, records system metrics while it runs, and the experiment is a
model-training one; the registered sft model loads with mlflow.transformers (and as a pyfunc) and
gives GhostVis's logits and greedy tokens."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from ghostvis_core.data.ledger import Ledger
from ghostvis_core.home import Home
from ghostvis_core.plan.stages import stage, stage_names
from ghostvis_core.run.hf.register import MODEL_FILE
from ghostvis_core.runs.launch_spec import LaunchSpec
from ghostvis_core.runs.lookup import run_result
from ghostvis_core.runs.preflight_findings import preflight_record
from ghostvis_core.store.layout import fill
from tests.conftest import copy_home, free_port, run_cli
from tests.test_e2e_demo import dagster_instance, latest
from tests.test_mlflow_outage import start_server, stop_server

STAGES = stage_names()
MODEL = "ghostvis"  # the registered model: named like the MLflow experiment


def own_artifacts(home: Path) -> None:
    """MLflow stores the experiment's artifact folder as an absolute URI, so a copied home still names
    the home it was copied from: point the copy at its own, so the test writes nothing into that one."""
    with sqlite3.connect(home / "mlflow.db") as db:
        db.execute(
            "UPDATE experiments SET artifact_location = ? WHERE name = 'ghostvis'", ((home / "mlartifacts").as_uri(),)
        )


# `ghostvis train dpo --force` (the stage asset in this Python process, Dagster's in-process executor), then
# what that Dagster process imported and its pid, for test_the_dagster_process_plans_and_the_job_does_the_heavy_work
TRAIN_DPO_IN_DAGSTER = """
import json, os, sys
from ghostvis_pipeline.cli import main
rc = main(["train", "dpo", "--force"])
heavy = [m for m in ("torch", "transformers", "mlflow.transformers") if m in sys.modules]
print("DAGSTER_PROCESS " + json.dumps({"pid": os.getpid(), "heavy_imports": heavy}))
sys.exit(rc)
"""


# Then, in one Dagster process: dpo again (a cache hit: the alias is on its version, so nothing registers) and
# the evaluation on one harness task (an identity not scored before: the evaluation job runs), and what that
# process imported
HIT_AND_EVALUATION_IN_DAGSTER = """
import json, os, sys
from dagster import DagsterInstance
from ghostvis_pipeline.definitions import defs
from ghostvis_pipeline.demo import materialize
materialize(defs, DagsterInstance.get(), ["dpo"])
config = {"ops": {"evaluation": {"config": {"harness_tasks": ["ghostvis_capitals"]}}}}
materialize(defs, DagsterInstance.get(), ["evaluation"], run_config=config)
heavy = [m for m in ("torch", "transformers", "mlflow.transformers", "lm_eval") if m in sys.modules]
print("DAGSTER_PROCESS " + json.dumps({"pid": os.getpid(), "heavy_imports": heavy}))
"""


def said_by_dagster(proc, home: Path, name: str) -> None:
    """What the Dagster process printed of itself, kept as <home>/../<name>."""
    said = next(line for line in proc.stdout.splitlines() if line.startswith("DAGSTER_PROCESS "))
    (home.parent / name).write_text(said.removeprefix("DAGSTER_PROCESS "))


@pytest.fixture(scope="module")
def registry(demo_home, module_tmp):
    """A copy of the demo home (whose stage materializations registered every stage's model) with its
    MLflow store served by `mlflow server`, in which dpo was trained again (--force: a second version,
    the alias moved to it) and then materialized through Dagster (a cache hit: no third version) with an
    evaluation on one harness task: (home, tracking URI). What each Dagster process said of itself is in
    <home>/../dagster_process.json (the training) and hit_and_evaluation.json."""
    home = module_tmp("registry") / "home"
    copy_home(demo_home, home)
    own_artifacts(home)
    port = free_port()
    server = start_server(port, home)  # its backend: the home's own sqlite store
    uri = f"http://127.0.0.1:{port}"
    try:
        proc = run_cli(["python", "-c", TRAIN_DPO_IN_DAGSTER], home, MLFLOW_TRACKING_URI=uri)
        said_by_dagster(proc, home, "dagster_process.json")
        proc = run_cli(["python", "-c", HIT_AND_EVALUATION_IN_DAGSTER], home, MLFLOW_TRACKING_URI=uri)
        said_by_dagster(proc, home, "hit_and_evaluation.json")
        yield home, uri
    finally:
        stop_server(server)


@pytest.mark.e2e
def test_every_stage_has_one_model_version_with_its_alias_and_lineage(registry):
    from mlflow.tracking import MlflowClient

    home, uri = registry
    client, instance = MlflowClient(uri), dagster_instance(home)
    assert "cached_from" in latest(instance, "dpo")  # the last materialization was a hit: no new version
    for name in STAGES:
        assert_registered(client, instance, home, name)
    dpo_versions = [v for v in client.search_model_versions(f"name = '{MODEL}'") if v.tags["ghostvis.stage"] == "dpo"]
    assert len(dpo_versions) == 2  # the demo's and the retrained run's; the alias is on the newer (above)


@pytest.mark.e2e
def test_runs_list_their_shards_and_system_metrics_in_a_model_training_experiment(registry):
    from mlflow.tracking import MlflowClient

    home, uri = registry
    client, instance = MlflowClient(uri), dagster_instance(home)
    exp = client.get_experiment_by_name("ghostvis")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    for name in ("sft", "dpo"):  # trained by the demo, and through the server
        md = latest(instance, name)
        assert_datasets(client, home, name, md)
        assert_system_metrics(client, md["mlflow_run_id"])
        assert md["mlflow_url"].endswith(f"/runs/{md['mlflow_run_id']}?workflowType=machine_learning")


@pytest.mark.e2e
def test_the_dagster_process_plans_and_the_job_does_the_heavy_work(registry):
    """`ghostvis train dpo --force` ran the stage asset in its own Python process (Dagster's in-process
    executor), which never imported torch, transformers or MLflow's model logging: the pre-flight (it builds the
    objective) and the export and registration ran in the job's rank 0, another process, named by the
    run's preflight.json and the materialization's `mlflow_model_registered_by`."""
    from dagster import AssetKey

    home, _ = registry
    dagster = json.loads((home.parent / "dagster_process.json").read_text())
    assert dagster["heavy_imports"] == []
    records = dagster_instance(home).fetch_materializations(AssetKey("dpo"), limit=2).records
    hit, trained = [{k: getattr(v, "value", v) for k, v in r.asset_materialization.metadata.items()} for r in records]
    assert "cached_from" in hit and "cached_from" not in trained and hit["run_key"] == trained["run_key"]
    store = Home(home).store
    pre = store.read_json("run_file", "dpo", trained["run_key"], "preflight.json")
    assert pre["pid"] != dagster["pid"] and "refused" not in pre
    assert trained["mlflow_model_registered_by"] == f"pid {pre['pid']} on {pre['host']}"  # the same rank 0
    assert hit["mlflow_model_version"] == trained["mlflow_model_version"]
    found = preflight_record(store, "dpo", trained["run_key"])
    assert found.source_budget and {s: asdict(b) for s, b in found.source_budget.items()} == pre["source_budget"]
    spec_file = Path(store.uri_of("run_spec", "dpo", trained["run_key"]))
    pre_file = Path(store.uri_of("run_file", "dpo", trained["run_key"], "preflight.json"))
    assert spec_file.stat().st_mtime_ns < pre_file.stat().st_mtime_ns  # the launch record is not written after it
    assert "source_budget" not in spec_file.read_text()
    for source, b in found.source_budget.items():  # the materialization's budget table is the job's
        assert f"| {source} | {b.needed_tokens:,} | {b.available_tokens:,} |" in trained["source_budget"]


@pytest.mark.e2e
def test_a_cache_hit_and_the_evaluation_import_no_torch_in_the_dagster_process(registry):
    """dpo's cache hit and an evaluation that scored (a new identity) ran in one Dagster process that never
    imported torch, transformers or lm_eval: the hit's version is the one its training job registered (another
    pid; the alias already on it, nothing was launched), the scores the evaluation job's, in the store and in
    MLflow."""
    from dagster import AssetKey
    from mlflow.tracking import MlflowClient

    from ghostvis_core.plan.selected import lineage

    home, uri = registry
    dagster = json.loads((home.parent / "hit_and_evaluation.json").read_text())
    assert dagster["heavy_imports"] == []
    instance = dagster_instance(home)
    hit, trained = [
        {k: getattr(v, "value", v) for k, v in r.asset_materialization.metadata.items()}
        for r in instance.fetch_materializations(AssetKey("dpo"), limit=2).records
    ]
    assert hit["cached_from"]["run_key"] == trained["run_key"]
    assert hit["mlflow_model_version"] == trained["mlflow_model_version"]
    assert not hit["mlflow_model_registered_by"].startswith(f"pid {dagster['pid']} ")
    evaluation = latest(instance, "evaluation")
    assert "cached_from" not in evaluation and set(evaluation["harness"]["dpo"]) == {"ghostvis_capitals"}
    scores = Home(home).store.read_json("report", f"evaluation/{evaluation['identity']}.json")
    assert list(scores) == lineage().stage_names() and set(evaluation["harness"]) == set(scores)  # in lineage order
    assert scores["dpo"]["run_key"] == trained["run_key"]
    logged = MlflowClient(uri).get_run(trained["mlflow_run_id"]).data.metrics
    assert logged["harness/ghostvis_capitals/acc"] == scores["dpo"]["harness"]["ghostvis_capitals"]["acc"]
    assert logged["eval/mc/overall"] == scores["dpo"]["mc"]["overall"]


def assert_registered(client, instance, home: Path, name: str) -> None:
    """The stage's current materialization: its MLflow run has exactly one version, the stage's alias
    points at it, its tags carry the run key, stage, tokenizer and parent run (key and MLflow run)."""
    md = latest(instance, name)
    versions = client.search_model_versions(f"name = '{MODEL}' and run_id = '{md['mlflow_run_id']}'")
    assert len(versions) == 1, f"{name}: {len(versions)} versions for run {md['run_key']}"
    v = versions[0]
    assert client.get_model_version_by_alias(MODEL, name).version == v.version
    assert (md["mlflow_model"], md["mlflow_model_version"]) == (f"models:/{MODEL}@{name}", int(v.version))
    tags = v.tags
    assert (tags["ghostvis.stage"], tags["ghostvis.run_key"], tags["ghostvis.tokenizer_id"]) == (
        name,
        md["run_key"],
        md["tokenizer_id"],
    )
    up = stage(name).upstream
    if up:  # the run it started from: the upstream's newest, except below a stage the fixture retrained (rl)
        parent = run_result(Home(home).store, up, md["parent_run_key"])
        assert tags["ghostvis.parent_run_key"] == md["parent_run_key"] == parent.run_key
        assert tags["ghostvis.parent_mlflow_run_id"] == parent.mlflow_run_id
        if name not in STAGES[STAGES.index("dpo") + 1 :]:  # above the retrained dpo: the upstream's newest
            assert parent.run_key == latest(instance, up)["run_key"]
    else:
        assert "ghostvis.parent_run_key" not in tags


def assert_datasets(client, home: Path, name: str, md: dict) -> None:
    """The run's dataset inputs: the train shards it read (per the ledger) and its validation shards,
    each named by shard id, digest = the ledger's sha256 as far as MLflow stores it (36 characters),
    the full hash in the profile, the raw shard (whose sha256 it is) as source, the split as context."""
    store = Home(home).store
    ledger = Ledger.in_store(store)
    rows = {r.shard_id: r for r in ledger.shards(tokenizer_id=md["tokenizer_id"])}
    spec = LaunchSpec.from_dict(store.read_json("run_spec", name, md["run_key"]))
    read = {r.shard_id for r in ledger.consumed_by_shard(md["run_key"])}
    val = {r.shard_id for refs in spec.val_shards.values() for r in refs}
    inputs = {d.dataset.name: d for d in client.get_run(md["mlflow_run_id"]).inputs.dataset_inputs}
    assert read and set(inputs) == read | val, name
    for shard_id, d in inputs.items():
        sha = rows[shard_id].content_sha256
        assert len(sha) == 64 and d.dataset.digest == sha[:36], shard_id
        assert json.loads(d.dataset.profile)["content_sha256"] == sha
        # the raw shard in the store; MLflow shares a dataset by name and digest within an experiment, so
        # in a copied home it keeps the store path under which it was first logged
        source, local = json.loads(d.dataset.source)["uri"], store.fetch("raw_shard", shard_id)
        assert source.endswith("/" + fill("raw_shard", (shard_id,))), (source, local)
        assert hashlib.sha256(local.read_bytes()).hexdigest() == sha
        context = {t.key: t.value for t in d.tags}["mlflow.data.context"]
        assert context == rows[shard_id].split == ("validation" if shard_id in val else "train")


def assert_system_metrics(client, run_id: str) -> None:
    """CPU and memory sampled while the run ran, and not after it ended."""
    run = client.get_run(run_id)
    for key in ("system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"):
        history = client.get_metric_history(run_id, key)
        assert history, f"{key} missing from run {run.info.run_name}"
        assert all(run.info.start_time <= m.timestamp <= run.info.end_time for m in history), key
    assert client.get_metric_history(run_id, "system/system_memory_usage_megabytes")[0].value > 0


@pytest.mark.e2e
def test_the_registered_dpo_model_loads_and_gives_ghostvis_logits_and_tokens(registry, monkeypatch):
    """The version logged through the server (its artifacts in this home; the demo's versions name the
    artifact folder of the home they were made in)."""
    import mlflow.pyfunc
    import mlflow.transformers

    from ghostvis_core.run.trained_model import load_stage

    home, uri = registry
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # as a user would point MLflow at the server
    parts = mlflow.transformers.load_model(f"models:/{MODEL}@dpo", return_type="components")
    hf = parts["model"].float().eval()
    ours = load_stage(Home(home), "dpo", latest(dagster_instance(home), "dpo")["run_key"])
    ids = torch.tensor([ours.tok.encode("What is 12 plus 7? The answer is")])
    with torch.no_grad():
        assert (hf(ids).logits - ours.model(ids).float()).abs().max().item() <= 1e-4
        greedy = hf.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1] :].tolist()
        theirs, x = [], ids
        for _ in range(16):
            nxt = ours.model(x)[0, -1].argmax().item()
            theirs.append(nxt)
            x = torch.cat([x, torch.tensor([[nxt]])], dim=1)
    assert greedy and greedy == theirs[: len(greedy)]  # generate() may stop at the end-of-text token
    out = mlflow.pyfunc.load_model(f"models:/{MODEL}@dpo").predict(["What is 12 plus 7?"])
    assert isinstance(out[0], str) and out[0]


@pytest.mark.e2e
def test_an_unreachable_registry_leaves_the_run_and_says_so(home_copy, monkeypatch):
    """As on a cache hit: the registration runs as a job of its own (launched like training), which records
    MLflow's refusal."""
    from dagster import MaterializeResult, asset, materialize

    from ghostvis_pipeline.assets.training import model_metadata
    from ghostvis_pipeline.launchers import Launcher

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    home = Home(home_copy)
    run_key = latest(dagster_instance(home_copy), "sft")["run_key"]
    spec = LaunchSpec.from_dict(home.store.read_json("run_spec", "sft", run_key))
    md = {}

    @asset
    def sft(context):  # a Dagster step, as the stage asset's: the registration job reports through Pipes
        md.update(model_metadata(context, stage("sft"), spec, home, Launcher(), registered_by_job=False))
        return MaterializeResult()

    assert materialize([sft]).success
    assert list(md) == ["mlflow_model"]
    assert md["mlflow_model"].startswith(f"sft: the model of run {run_key} is not registered in MLflow")
    assert md["mlflow_model"].endswith("materialize sft again (a cache hit) to register it")


@pytest.mark.e2e
def test_a_cache_hit_launches_a_registration_job_only_when_the_alias_is_on_another_version(home_copy, monkeypatch):
    """A copy of the demo home (its MLflow database came along): the alias on the run's version, a cache hit's
    model metadata launches nothing (the run's registration record is not rewritten); the alias moved to another
    run's version, the registration job runs and points it back, registering no new version."""
    from dagster import MaterializeResult, asset, materialize
    from mlflow.tracking import MlflowClient

    from ghostvis_pipeline.assets.training import model_metadata
    from ghostvis_pipeline.launchers import Launcher

    for var, value in (("GHOSTVIS_HOME", home_copy), ("DAGSTER_HOME", home_copy / "dagster")):
        monkeypatch.setenv(var, str(value))
    home = Home(home_copy)
    run_key = latest(dagster_instance(home_copy), "dpo")["run_key"]
    spec = LaunchSpec.from_dict(home.store.read_json("run_spec", "dpo", run_key))
    record = Path(home.store.uri_of("run_file", "dpo", run_key, MODEL_FILE))
    client = MlflowClient(home.mlflow_tracking_uri)
    own = int(client.get_model_version_by_alias(MODEL, "dpo").version)
    versions = len(client.search_model_versions(f"name = '{MODEL}'"))

    def hit() -> dict:
        md = {}

        @asset
        def dpo(context):  # a Dagster step, as the stage asset's
            md.update(model_metadata(context, stage("dpo"), spec, home, Launcher(), registered_by_job=False))
            return MaterializeResult()

        assert materialize([dpo]).success
        return md

    written = record.stat().st_mtime_ns
    assert hit()["mlflow_model_version"].value == own and record.stat().st_mtime_ns == written  # nothing launched
    other = int(client.get_model_version_by_alias(MODEL, "sft").version)
    client.set_registered_model_alias(MODEL, "dpo", str(other))
    md = hit()
    assert md["mlflow_model_version"].value == own and record.stat().st_mtime_ns > written  # the job's record
    assert int(client.get_model_version_by_alias(MODEL, "dpo").version) == own
    assert len(client.search_model_versions(f"name = '{MODEL}'")) == versions


def sampled(monkeypatch, interval: str, run_for: float) -> list[tuple[dict[str, float], int]]:
    """The points the system-metrics sampler hands the outbox while it runs for `run_for` seconds,
    and none after finish() (nothing listens at the tracking URI: nothing is sent there)."""
    import time

    from ghostvis_core.run.track.mlflow_system import OutboxSystemMetrics

    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", interval)
    points: list = []
    monitor = OutboxSystemMetrics(
        "run", f"http://127.0.0.1:{free_port()}", lambda m, step: points.append((m, step)), resume=False
    )
    monitor.start()
    time.sleep(run_for)
    monitor.finish()
    after = len(points)
    time.sleep(min(3 * float(interval), 1.0))  # three more intervals, or a second: a sampler still running shows
    assert len(points) == after
    return points


def test_system_metrics_are_sampled_each_interval_and_stop_with_the_run(monkeypatch):
    points = sampled(monkeypatch, "0.2", 1.5)
    assert 4 <= len(points) <= 9 and [step for _, step in points] == list(range(len(points)))
    for metrics, _ in points:
        assert 0 <= metrics["system/cpu_utilization_percentage"] <= 100
        assert metrics["system/system_memory_usage_megabytes"] > 0


def test_a_run_shorter_than_one_interval_gets_one_sample(monkeypatch):
    points = sampled(monkeypatch, "30", 0.3)
    assert len(points) == 1 and points[0][0]["system/system_memory_usage_megabytes"] > 0


def test_registering_leaves_the_callers_mlflow_environment_as_it_was(tmp_path, monkeypatch):
    """MLflow's fluent API writes MLFLOW_TRACKING_URI into the process's environment; a Dagster
    process that registered a model must not keep that server as its tracking URI. Inside, MLflow's
    requirements check (a pip dry run) is off; outside, the caller's setting is back."""
    import mlflow
    from mlflow import MlflowClient
    from mlflow.environment_variables import MLFLOW_SKIP_PIP_REQUIREMENTS_CHECK

    from ghostvis_core.run.track.mlflow_models import fluent_scope

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    experiment_id = MlflowClient(uri).create_experiment("scoped")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", "0")
    monkeypatch.delenv(MLFLOW_SKIP_PIP_REQUIREMENTS_CHECK.name, raising=False)
    with fluent_scope(uri, experiment_id):
        assert mlflow.get_tracking_uri() == uri
        assert MLFLOW_SKIP_PIP_REQUIREMENTS_CHECK.get() is True
        with mlflow.start_run() as run:
            assert run.info.experiment_id == experiment_id
    assert "MLFLOW_TRACKING_URI" not in os.environ and os.environ["MLFLOW_EXPERIMENT_ID"] == "0"
    assert MLFLOW_SKIP_PIP_REQUIREMENTS_CHECK.name not in os.environ
    assert mlflow.get_tracking_uri() != uri

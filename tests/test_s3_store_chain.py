"""The whole smoke chain with the artifact store in a bucket (GHOSTVIS_STORE=s3://..., moto's S3 server):
sources -> shards -> tokenizer -> token shards -> ledger -> every stage -> evaluation -> report, through the
real `ghostvis demo` CLI, then `ghostvis export` and `ghostvis audit`. One run of the chain, shared by the
tests below: every check passes, nothing is written to the home's own store folder, the bucket holds the
records and checkpoints, and the ledger in the bucket agrees with MLflow to the token.

The chain is a lineage with one stage of each objective (LINEAGE): the store path a stage takes depends on its
objective (pretraining, vision alignment, sft, dpo, GRPO's rollouts), not on its name, and the session's demo home
trains the whole table on a folder store."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import boto3
import pytest
from mlflow.tracking import MlflowClient

from ghostvis_core.counts import MLFLOW_METRICS
from ghostvis_core.data.ledger import Ledger
from ghostvis_core.home import Home
from ghostvis_core.plan import stages
from ghostvis_core.plan.lineage import parse
from ghostvis_core.runs.lookup import completed_runs
from ghostvis_core.store import open_store
from ghostvis_core.verify.audit.data_checks import DATA_CHECKS
from ghostvis_core.verify.audit.stage_checks import stage_check_names
from ghostvis_core.verify.replay.refusal import REPLAYABLE_OBJECTIVES
from tests.conftest import new_bucket, run_cli, s3_env

# the first test waits for the whole chain (its module fixture), longer than the suite's 900 s per test
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]

LINEAGE = "pretrain,vision_alignment,sft,dpo,rl"
STAGES = parse(LINEAGE).stage_names()
BUCKET, PREFIX = "chain", "team/store"
STORE_URI = f"s3://{BUCKET}/{PREFIX}"


@dataclass
class Chain:
    home: Path
    env: dict[str, str]
    demo_stdout: str
    export_dir: Path
    audit: object  # the `ghostvis audit` CompletedProcess


@pytest.fixture(scope="module")
def chain(moto_s3, module_tmp) -> Chain:
    """`ghostvis demo --preset smoke` (every stage, evaluation and report), `ghostvis export` of the last
    stage and `ghostvis audit`, all with the store in the bucket and this node's cache outside the home."""
    tmp = module_tmp("s3-chain")
    env = {**s3_env(moto_s3, tmp), "GHOSTVIS_STORE": STORE_URI, "GHOSTVIS_STORE_CACHE": str(tmp / "node-cache")}
    env["GHOSTVIS_LINEAGE"] = LINEAGE
    new_bucket(moto_s3, BUCKET)
    home = tmp / "home"
    demo = run_cli(["ghostvis", "demo", "--preset", "smoke"], home, timeout=2400, **env)
    export_dir = tmp / "export"
    run_cli(["ghostvis", "export", "--stage", STAGES[-1], "--to", str(export_dir)], home, **env)
    audit = run_cli(["ghostvis", "audit"], home, check=False, **env)
    return Chain(home, env, demo.stdout, export_dir, audit)


@pytest.fixture(scope="module")
def reader(chain, module_tmp):
    """The bucket store as another machine sees it (its own, empty cache): (store, MLflow client)."""
    with pytest.MonkeyPatch.context() as mp:
        for var, value in chain.env.items():
            mp.setenv(var, value)
        mp.setenv("GHOSTVIS_STORE_CACHE", str(module_tmp("reader-cache")))
        yield open_store(STORE_URI), MlflowClient(Home(chain.home).mlflow_tracking_uri)


def bucket_objects(chain: Chain) -> list[str]:
    s3 = boto3.client(
        "s3",
        endpoint_url=chain.env["AWS_ENDPOINT_URL_S3"],
        region_name="us-east-1",
        aws_access_key_id="test",
        aws_secret_access_key="test",
    )
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"{PREFIX}/")
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


def test_every_asset_is_materialized_and_every_check_passes(chain):
    for asset in [
        "shard_manifest",
        "raw_shards",
        "tokenizer",
        "tokenized_shards",
        "token_ledger",
        *STAGES,
        "evaluation",
        "report",
    ]:
        assert f"\n{asset} " in chain.demo_stdout, f"{asset} missing from the per-asset breakdown:\n{chain.demo_stdout}"
    line = next(line for line in chain.demo_stdout.splitlines() if line.startswith("checks:"))
    passed, total = map(int, line.split()[1].split("/"))
    # 5 data checks (4 ledger, 1 tokenizer), the stages' checks and the evaluation's lineage quality gate
    # the tokenizer's check, the ledger's data checks, every stage's checks, the replayable stages' replay_matches,
    # the lineage quality gate
    replayed = [s for s in STAGES if stages.stage(s).objective in REPLAYABLE_OBJECTIVES]
    assert passed == total == 1 + len(DATA_CHECKS) + len(stage_check_names()) * len(STAGES) + len(replayed) + 1, line


def test_nothing_is_written_to_the_homes_store_folder(chain):
    store_folder = chain.home / "store"
    assert not store_folder.exists() or not any(store_folder.iterdir()), sorted(store_folder.rglob("*"))[:20]


def test_the_bucket_holds_every_stages_run_record_checkpoint_and_lineage(chain, reader):
    store, _ = reader
    objects = set(bucket_objects(chain))
    assert any(k.startswith(f"{PREFIX}/shards/tokens/") for k in objects)
    assert any(k.startswith(f"{PREFIX}/ledger/") for k in objects)
    for stage in STAGES:
        (run,) = completed_runs(store, stage)
        prefix = f"{STORE_URI}/checkpoints/{stage}/{run.run_key}/step_"
        assert run.checkpoint_uri.startswith(prefix), (stage, run.checkpoint_uri)
        step = run.checkpoint_uri.rsplit("/", 1)[1]
        assert f"{PREFIX}/checkpoints/{stage}/{run.run_key}/{step}/COMPLETE" in objects
        assert f"{PREFIX}/checkpoints/{stage}/{run.run_key}/RUN_COMPLETE.json" in objects
        assert f"{PREFIX}/runs/{stage}/{run.run_key}/spec.json" in objects
        parent = parse(LINEAGE).upstream(stage)
        if parent:
            assert run.parent_run_key == completed_runs(store, parent)[0].run_key, stage
    report_files = {
        k.rsplit("/", 1)[1]
        for k in objects
        if k.startswith(f"{PREFIX}/reports/") and not k.startswith(f"{PREFIX}/reports/evaluation/")
    }
    assert {"report.html", "report.md", "report.json", "loss_curves.png"} <= report_files, report_files


def test_the_ledger_in_the_bucket_equals_mlflow_to_the_token(reader):
    store, client = reader
    ledger = Ledger.in_store(store)
    for stage in STAGES:
        (run,) = completed_runs(store, stage)
        totals = ledger.run_totals(run.run_key)
        metrics = client.get_run(run.mlflow_run_id).data.metrics
        assert totals.counts.real_tokens > 0, stage
        for key, metric in MLFLOW_METRICS.items():
            assert getattr(totals.counts, key) == int(metrics[metric]) == getattr(run.counts, key), (stage, key)


def test_audit_passes_from_the_bucket(chain):
    assert chain.audit.returncode == 0, chain.audit.stdout[-4000:] + chain.audit.stderr[-4000:]


def test_the_last_stage_exports_from_the_bucket(chain, reader):
    store, _ = reader
    config = json.loads((chain.export_dir / "config.json").read_text())
    (run,) = completed_runs(store, STAGES[-1])
    trained = json.loads(store.read_text("run_spec", STAGES[-1], run.run_key))["config"]["model"]
    assert (config["hidden_size"], config["num_hidden_layers"]) == (trained["d_model"], trained["n_layers"])
    assert (chain.export_dir / "model.safetensors").is_file() and (chain.export_dir / "tokenizer.json").is_file()

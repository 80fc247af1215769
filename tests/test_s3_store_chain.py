"""A smoke chain with the whole artifact store in a bucket (GHOSTVIS_STORE=s3://..., moto's S3 server):
sources -> shards -> tokenizer -> token shards -> ledger -> pretrain -> continued_pretrain, through the
real `ghostvis demo` CLI, every check passing and nothing written to the home's own store folder."""

from __future__ import annotations

import boto3
import pytest

from ghostvis_core.data.ledger import Ledger
from ghostvis_core.store import open_store
from ghostvis_core.train.runs import completed_runs
from tests.conftest import new_bucket, run_cli, s3_env

pytestmark = pytest.mark.e2e


def test_a_smoke_chain_with_the_store_in_s3_passes_every_check(moto_s3, tmp_path, monkeypatch):
    env = {**s3_env(moto_s3, tmp_path), "GHOSTVIS_STORE": "s3://chain/team/store",
           "GHOSTVIS_STORE_CACHE": str(tmp_path / "node-cache")}
    new_bucket(moto_s3, "chain")
    home = tmp_path / "home"
    proc = run_cli(["ghostvis", "demo", "--preset", "smoke", "--stages", "pretrain", "continued_pretrain"], home,
                   timeout=900, **env)
    assert "FAILED" not in proc.stdout and "checks: " in proc.stdout, proc.stdout
    assert not (home / "store").exists()  # every artifact went to the bucket

    for var, value in env.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setenv("GHOSTVIS_STORE_CACHE", str(tmp_path / "reader-cache"))  # another machine's view
    store = open_store("s3://chain/team/store")
    objects = [o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket="chain", Prefix="team/store/")["Contents"]]
    assert any(k.startswith("team/store/shards/tokens/") for k in objects)
    assert any(k.startswith("team/store/ledger/parts/") for k in objects)
    ledger = Ledger.in_store(store)
    for stage, parent in (("pretrain", None), ("continued_pretrain", "pretrain")):
        (run,) = completed_runs(store, stage)
        assert run.counts == ledger.run_counts(run.run_key)  # the trainer's figures = the bucket's ledger
        assert run.checkpoint_uri.startswith(f"s3://chain/team/store/checkpoints/{stage}/{run.run_key}/step_")
        assert f"team/store/checkpoints/{stage}/{run.run_key}/{run.checkpoint_uri.rsplit('/', 1)[1]}/COMPLETE" in objects
        if parent:
            assert run.parent_run_key == completed_runs(store, parent)[0].run_key

"""The artifact store: every artifact by kind and key, atomic writes, listing by key prefix."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from ghostvis_core.errors import GhostvisError
from ghostvis_core.s3_store import S3Store
from ghostvis_core.store import LAYOUT, LocalStore, open_store
from ghostvis_core.train.setup import newest_checkpoint
from tests.conftest import new_bucket, s3_env


def test_paths_follow_the_layout_and_shard_ids_keep_their_source_folder(tmp_path):
    store = LocalStore(tmp_path)
    assert store.path("raw_shard", "demo_prose/00001") == tmp_path / "shards/raw/demo_prose/00001.parquet"
    assert store.path("token_shard", "tok-1", "demo_prose/00001") == tmp_path / "shards/tokens/tok-1/demo_prose/00001.arrow"
    assert store.path("run_record", "sft", "sft-abc-r1") == tmp_path / "checkpoints/sft/sft-abc-r1/RUN_COMPLETE.json"
    assert set(LAYOUT) >= {"manifest", "raw_shard", "tokenizer", "token_shard", "ledger", "checkpoints", "run_record",
                           "run_spec", "run_error", "report"}


def test_json_round_trip_and_keys_by_prefix_oldest_first(tmp_path):
    store = LocalStore(tmp_path)
    for i, (stage, key) in enumerate([("sft", "sft-b-r1"), ("sft", "sft-a-r1"), ("dpo", "dpo-a-r1")]):
        path = store.write_json("run_record", stage, key, data={"n": i})
        os.utime(path, (time.time() + i, time.time() + i))
    assert store.read_json("run_record", "sft", "sft-a-r1") == {"n": 1}
    assert store.keys("run_record", "sft") == [("sft", "sft-b-r1"), ("sft", "sft-a-r1")]
    assert store.keys("run_record") == [("sft", "sft-b-r1"), ("sft", "sft-a-r1"), ("dpo", "dpo-a-r1")]
    store.write_text("raw_shard", "web/00003", text="x")
    assert store.keys("raw_shard") == [("web/00003",)]


def test_writes_leave_no_temporary_files_and_put_file_keeps_an_existing_artifact(tmp_path):
    store = LocalStore(tmp_path / "s")
    store.write_text("report", "a.md", text="one")
    src = tmp_path / "part.parquet"
    src.write_text("first")
    store.put_file("ledger_file", "parts/p1.parquet", src=src)
    src.write_text("second")
    store.put_file("ledger_file", "parts/p1.parquet", src=src)
    assert store.read_text("ledger_file", "parts/p1.parquet") == "first"
    assert sorted(p.name for p in (tmp_path / "s").rglob("*") if p.is_file()) == ["a.md", "p1.parquet"]


def test_bad_kinds_keys_and_missing_artifacts_are_named(tmp_path):
    store = LocalStore(tmp_path)
    with pytest.raises(GhostvisError, match="unknown artifact kind 'shard'; kinds: manifest"):
        store.path("shard", "x")
    with pytest.raises(GhostvisError, match="'token_shard' takes 2 key part"):
        store.path("token_shard", "x")
    with pytest.raises(GhostvisError, match="invalid key part '..'"):
        store.path("run_spec", "sft", "..")
    with pytest.raises(GhostvisError, match="run_spec sft/k is not in the store .*; materialize what writes it first"):
        store.read_json("run_spec", "sft", "k")


def test_open_store_takes_paths_file_and_s3_uris_and_refuses_what_it_cannot_reach(tmp_path, s3):
    assert open_store(str(tmp_path)).root == tmp_path
    assert open_store(tmp_path.as_uri()).root == tmp_path
    remote = open_store("s3://bucket-a/team/store")
    assert (remote.bucket, remote.prefix, remote.uri) == ("bucket-a", "team/store", "s3://bucket-a/team/store")
    assert remote.root == tmp_path / "cache" / "bucket-a" / "team/store"
    with pytest.raises(GhostvisError, match="gs://b/p: give a folder .* or s3://bucket/prefix"):
        open_store("gs://b/p")


# --- the store in a bucket (moto's S3 server) ---------------------------------------------------------


@pytest.fixture
def s3(moto_s3, tmp_path, monkeypatch):
    for var, value in s3_env(moto_s3, tmp_path).items():
        monkeypatch.setenv(var, value)
    monkeypatch.setenv("GHOSTVIS_STORE_CACHE", str(tmp_path / "cache"))
    name = f"b-{uuid.uuid4().hex[:10]}"
    new_bucket(moto_s3, name)
    return name


def node(bucket: str, cache: Path) -> S3Store:
    """The same bucket seen from another machine: its own cache folder."""
    store = S3Store.from_uri(f"s3://{bucket}/store")
    store.root = cache
    return store


def test_s3_records_keys_and_folders_round_trip_between_nodes(s3, tmp_path):
    a, b = node(s3, tmp_path / "a"), node(s3, tmp_path / "b")
    a.write_json("run_record", "sft", "sft-x-r1", data={"steps": 8})
    assert b.read_json("run_record", "sft", "sft-x-r1") == {"steps": 8}
    assert b.exists("run_record", "sft", "sft-x-r1") and not b.exists("run_record", "sft", "sft-y-r1")
    tok = a.path("tokenizer", "tok-1")
    tok.mkdir(parents=True)
    (tok / "meta.json").write_text("{}")
    (tok / "ranks.bin").write_bytes(b"\x00" * 1000)
    a.publish("tokenizer", "tok-1")
    assert b.keys("tokenizer") == [("tok-1",)]
    got = b.fetch("tokenizer", "tok-1")
    assert got == tmp_path / "b" / "tokenizers" / "tok-1" and (got / "ranks.bin").read_bytes() == b"\x00" * 1000
    assert b.uri_of("tokenizer", "tok-1") == f"s3://{s3}/store/tokenizers/tok-1"
    b.delete("tokenizer", "tok-1")
    assert not a.exists("tokenizer", "tok-1") and a.keys("tokenizer") == []
    with pytest.raises(GhostvisError, match=f"run_spec sft/k is not in the store \\(s3://{s3}/store/runs/sft/k/spec.json\\)"):
        b.read_json("run_spec", "sft", "k")


def test_a_checkpoint_upload_cut_before_its_marker_is_not_resumed(s3, tmp_path):
    """The marker goes up last: a step whose upload stopped before it is invisible, and the node that
    resumes takes the previous committed checkpoint."""
    writer, reader = node(s3, tmp_path / "w"), node(s3, tmp_path / "r")
    for step in ("step_000000004", "step_000000008"):
        folder = writer.path("checkpoint", "pretrain", "k-r1", step)
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(step.encode() * 100)
        (folder / "COMPLETE").write_text(step)
    writer.publish("checkpoint", "pretrain", "k-r1", "step_000000004")
    uploads = []
    writer.s3.meta.events.register("provide-client-params.s3.PutObject", lambda params, **_: uploads.append(params["Key"]))
    writer.publish("checkpoint", "pretrain", "k-r1", "step_000000008")
    assert [k.rsplit("/", 1)[1] for k in uploads] == ["model.safetensors", "COMPLETE"]  # marker last
    writer.s3.delete_object(Bucket=s3, Key=writer.object_key("checkpoint_marker", "pretrain", "k-r1", "step_000000008"))
    spec = SimpleNamespace(stage="pretrain", run_key="k-r1")
    resumed = newest_checkpoint(reader, spec)
    assert resumed.step == 4 and (resumed.path / "model.safetensors").read_bytes() == b"step_000000004" * 100


def test_a_corrupted_object_fails_its_download_by_name(s3, tmp_path):
    a, b = node(s3, tmp_path / "a"), node(s3, tmp_path / "b")
    path = a.path("raw_shard", "web/00001")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"good bytes")
    a.publish("raw_shard", "web/00001")
    name = a.object_key("raw_shard", "web/00001")
    sha = a.s3.head_object(Bucket=s3, Key=name)["Metadata"]["sha256"]
    a.s3.put_object(Bucket=s3, Key=name, Body=b"bad bytes!", Metadata={"sha256": sha})
    with pytest.raises(GhostvisError, match=f"shards/raw/web/00001.parquet: checksum mismatch after download \\(expected {sha}"):
        b.fetch("raw_shard", "web/00001")
    assert not b.path("raw_shard", "web/00001").exists()

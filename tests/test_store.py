"""The artifact store: every artifact by kind and key, through one protocol with two implementations.

The tests taking `store_nodes` run once on a folder store and once on a bucket store (moto's S3 server,
two nodes with their own cache folders): what the protocol promises holds for both."""

from __future__ import annotations

import uuid
from types import SimpleNamespace

import pytest
import torch

from ghostvis_core.errors import GhostvisError, TransferError
from ghostvis_core.home import Home
from ghostvis_core.run.train import checkpoint as ckpt
from ghostvis_core.run.train.checkpoint_manager import CheckpointManager
from ghostvis_core.run.train.dist import DistContext
from ghostvis_core.store import LAYOUT, S3Store, open_store
from ghostvis_core.store.files import atomic_write, sha256_file
from ghostvis_core.store.layout import fill, listing_prefix, step_dir_name
from tests.conftest import new_bucket, s3_env

# --- both implementations -----------------------------------------------------------------------------


def test_writes_return_the_artifacts_uri_and_the_other_node_reads_them(store_nodes):
    a, b, located = store_nodes.writer, store_nodes.reader, store_nodes.located
    assert a.write_json("run_record", "sft", "sft-x-r1", data={"steps": 8}) == located(
        "checkpoints/sft/sft-x-r1/RUN_COMPLETE.json"
    )
    assert a.write_text("run_file", "sft", "sft-x-r1", "slurm/1.sbatch", text="#!/bin/sh\n") == located(
        "runs/sft/sft-x-r1/slurm/1.sbatch"
    )
    assert b.read_json("run_record", "sft", "sft-x-r1") == {"steps": 8}
    assert b.read_text("run_file", "sft", "sft-x-r1", "slurm/1.sbatch") == "#!/bin/sh\n"
    assert b.exists("run_record", "sft", "sft-x-r1") and not b.exists("run_record", "sft", "sft-y-r1")
    assert b.uri_of("tokenizer", "tok-1") == located("tokenizers/tok-1")


def test_keys_list_by_key_prefix(store_nodes):
    a, b = store_nodes.writer, store_nodes.reader
    for stage, key in [("sft", "sft-b-r1"), ("sft", "sft-a-r1"), ("dpo", "dpo-a-r1")]:
        a.write_json("run_record", stage, key, data={})
    a.write_json("run_error", "sft", "sft-a-r1", "1", data={"rank": 1})
    a.write_text("raw_shard", "web/00003", text="x")
    assert sorted(b.keys("run_record", "sft")) == [("sft", "sft-a-r1"), ("sft", "sft-b-r1")]
    assert sorted(b.keys("run_record")) == [("dpo", "dpo-a-r1"), ("sft", "sft-a-r1"), ("sft", "sft-b-r1")]
    assert b.keys("run_error", "sft", "sft-a-r1") == [("sft", "sft-a-r1", "1")]
    assert b.keys("raw_shard") == [("web/00003",)] and b.keys("raw_shard", "web/00004") == []


def test_fetch_or_read_of_a_missing_artifact_names_it_and_the_fix(store_nodes):
    b, located = store_nodes.reader, store_nodes.located
    where = located("shards/raw/web/00009.parquet")
    with pytest.raises(
        GhostvisError,
        match=f"raw_shard web/00009 is not in the store \\({where}\\); materialize the asset that writes it first",
    ):
        b.fetch("raw_shard", "web/00009")
    with pytest.raises(GhostvisError, match="run_spec sft/k is not in the store .*; materialize the asset"):
        b.read_json("run_spec", "sft", "k")


def test_writable_then_publish_makes_a_folder_artifact_visible_to_the_other_node(store_nodes):
    a, b, located = store_nodes.writer, store_nodes.reader, store_nodes.located
    tok = a.writable("tokenizer", "tok-1")
    assert tok.parent.is_dir() and not tok.exists()
    tok.mkdir()
    (tok / "meta.json").write_text("{}")
    (tok / "ranks.bin").write_bytes(b"\x00" * 1000)
    assert b.exists("tokenizer", "tok-1") == a.shared_folder  # a bucket store: nobody sees it before publish
    assert a.publish("tokenizer", "tok-1") == located("tokenizers/tok-1")
    assert b.keys("tokenizer") == [("tok-1",)]
    got = b.fetch("tokenizer", "tok-1")
    assert (got / "ranks.bin").read_bytes() == b"\x00" * 1000 and (got / "meta.json").read_text() == "{}"
    b.delete("tokenizer", "tok-1")
    assert not a.exists("tokenizer", "tok-1") and a.keys("tokenizer") == []
    with pytest.raises(GhostvisError, match="ledger_file parts/x.parquet"):  # nothing was written there
        a.publish("ledger_file", "parts/x.parquet")


def test_put_file_keeps_an_existing_artifact_and_writes_leave_no_temporary_files(store_nodes, tmp_path):
    a, b, located = store_nodes.writer, store_nodes.reader, store_nodes.located
    src = tmp_path / "part.parquet"
    src.write_text("first")
    assert a.put_file("ledger_file", "parts/p1.parquet", src=src) == located("ledger/parts/p1.parquet")
    src.write_text("second")
    a.put_file("ledger_file", "parts/p1.parquet", src=src)
    a.write_text("ledger_file", "parts/p2.parquet", text="two")
    assert b.read_text("ledger_file", "parts/p1.parquet") == "first"
    folder = b.fetch("ledger_file", "parts")
    assert sorted(p.name for p in folder.iterdir()) == ["p1.parquet", "p2.parquet"]


def test_one_store_object_per_store_per_process(store_nodes, tmp_path, monkeypatch):
    uri = store_nodes.writer.uri
    assert open_store(uri) is open_store(uri) and open_store(uri).uri == uri
    monkeypatch.setenv("GHOSTVIS_STORE", uri)
    monkeypatch.setenv("GHOSTVIS_HOME", str(tmp_path / "home"))
    assert Home.from_env().store is Home.from_env().store is open_store(uri)


# --- layout, URIs, helpers ----------------------------------------------------------------------------


def test_locations_follow_the_layout_and_bad_kinds_and_keys_are_named():
    assert fill("raw_shard", ("demo_prose/00001",)) == "shards/raw/demo_prose/00001.parquet"
    assert (
        fill("token_shard", ("tok-1", "demo_prose/00001", "ab12")) == "shards/tokens/tok-1/demo_prose/00001/ab12.arrow"
    )
    assert fill("raw_shard_version", ("web/a", "ab12")) == "shards/raw_versions/web/a/ab12.parquet"
    assert fill("run_error", ("sft", "k", "3")) == "runs/sft/k/errors/3.json"
    assert listing_prefix("run_error", ("sft", "k")) == "runs/sft/k/errors"
    assert listing_prefix("checkpoints", ()) == "checkpoints"
    assert set(LAYOUT) >= {
        "manifest",
        "raw_shard",
        "tokenizer",
        "token_shard",
        "ledger",
        "checkpoints",
        "run_record",
        "run_spec",
        "run_error",
        "report",
    }
    with pytest.raises(GhostvisError, match="unknown artifact kind 'shard'; kinds: manifest"):
        fill("shard", ("x",))
    with pytest.raises(GhostvisError, match="'token_shard' takes 3 key part"):
        fill("token_shard", ("x",))
    with pytest.raises(GhostvisError, match="invalid key part '..'"):
        fill("run_spec", ("sft", ".."))


def test_open_store_takes_paths_file_and_s3_uris_and_refuses_what_it_cannot_reach(tmp_path, monkeypatch):
    monkeypatch.setenv("GHOSTVIS_STORE_CACHE", str(tmp_path / "cache"))
    folder = open_store(str(tmp_path))
    assert folder is open_store(tmp_path.as_uri()) and folder.uri == tmp_path.as_uri() and folder.shared_folder
    remote = open_store("s3://bucket-a/team/store")
    assert remote.uri == "s3://bucket-a/team/store" and not remote.shared_folder
    assert remote.uri_of("run_spec", "sft", "k") == "s3://bucket-a/team/store/runs/sft/k/spec.json"
    monkeypatch.setenv("GHOSTVIS_STORE_CACHE", str(tmp_path / "other-cache"))
    assert open_store("s3://bucket-a/team/store") is not remote  # another cache folder: another store object
    with pytest.raises(GhostvisError, match="gs://b/p: give a folder .* or s3://bucket/prefix"):
        open_store("gs://b/p")


def test_atomic_write_replaces_whole_and_sha256_file_hashes_the_bytes(tmp_path):
    path = tmp_path / "a" / "f.json"
    atomic_write(path, "one")
    atomic_write(path, b"two")
    assert path.read_bytes() == b"two" and [p.name for p in path.parent.iterdir()] == ["f.json"]
    assert sha256_file(path) == "3fc4ccfe745870e2c0d99f71f30ff0656c8dedd41cc1d7d3d376b0dbe685e2f3"


# --- the bucket store's own promises (moto's S3 server) -----------------------------------------------


@pytest.fixture
def s3(moto_s3, tmp_path, monkeypatch):
    for var, value in s3_env(moto_s3, tmp_path).items():
        monkeypatch.setenv(var, value)
    name = f"b-{uuid.uuid4().hex[:10]}"
    new_bucket(moto_s3, name)
    return name


def test_a_checkpoint_upload_cut_before_its_marker_is_not_resumed(s3, tmp_path):
    """The marker goes up last: a step whose upload stopped before it is invisible, and the node that
    resumes takes the previous committed checkpoint."""
    writer, reader = S3Store(s3, "store", tmp_path / "w"), S3Store(s3, "store", tmp_path / "r")
    for step in ("step_000000004", "step_000000008"):
        folder = writer.writable("checkpoint", "pretrain", "k-r1", step)
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(step.encode() * 100)
        ckpt.write_marker(folder, int(step.removeprefix("step_")))
    writer.publish("checkpoint", "pretrain", "k-r1", "step_000000004")
    uploads = []
    writer.s3.meta.events.register(
        "provide-client-params.s3.PutObject", lambda params, **_: uploads.append(params["Key"])
    )
    writer.publish("checkpoint", "pretrain", "k-r1", "step_000000008")
    assert [k.rsplit("/", 1)[1] for k in uploads] == ["model.safetensors", "COMPLETE"]  # marker last
    writer.s3.delete_object(Bucket=s3, Key=writer.object_key("checkpoint_marker", "pretrain", "k-r1", "step_000000008"))
    checkpoints = CheckpointManager(
        reader,
        SimpleNamespace(stage="pretrain", run_key="k-r1"),
        DistContext(0, 0, 1, torch.device("cpu")),
        keep_last=2,
        async_save=False,
        sharded=False,
    )
    resumed = checkpoints.newest()
    assert resumed.step == 4 and (resumed.path / "model.safetensors").read_bytes() == b"step_000000004" * 100


def test_a_refused_upload_names_the_checkpoint_and_leaves_the_previous_one_newest(s3, tmp_path):
    """S3 refuses the marker's PUT (AccessDenied, raised by botocore's own hook before the request): the commit
    fails naming the checkpoint and the newest committed one, and a resume on another node takes that one."""
    from botocore.exceptions import ClientError

    spec = SimpleNamespace(stage="pretrain", run_key="k-r2")
    cpu = DistContext(0, 0, 1, torch.device("cpu"))
    bucket = S3Store(s3, "store", tmp_path / "w")
    writer = CheckpointManager(bucket, spec, cpu, keep_last=2, async_save=False, sharded=False)
    for step in (4, 8):
        folder = writer.run_dir / step_dir_name(step)
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"w" * 100 * step)
        ckpt.write_marker(folder, step)

    def refuse(params, **_):
        if params["Key"].endswith("/COMPLETE") and "step_000000008" in params["Key"]:
            raise ClientError({"Error": {"Code": "AccessDenied", "Message": "Access Denied"}}, "PutObject")

    bucket.s3.meta.events.register("provide-client-params.s3.PutObject", refuse)
    writer.publish(writer.run_dir / "step_000000004")
    with pytest.raises(
        GhostvisError,
        match=r"checkpoint step_000000008 of run k-r2: the upload to s3://\S+/step_000000008 failed "
        r"\(.*Access Denied.*\); "
        r"its COMPLETE marker goes last, so the store's newest committed checkpoint is still step_000000004",
    ):
        writer.publish(writer.run_dir / "step_000000008")
    reader = CheckpointManager(
        S3Store(s3, "store", tmp_path / "r"), spec, cpu, keep_last=2, async_save=False, sharded=False
    )
    assert reader.newest().step == 4


def test_a_corrupted_download_is_refused_by_name(s3, tmp_path):
    a, b = S3Store(s3, "store", tmp_path / "a"), S3Store(s3, "store", tmp_path / "b")
    path = a.writable("raw_shard", "web/00001")
    path.write_bytes(b"good bytes")
    a.publish("raw_shard", "web/00001")
    name = a.object_key("raw_shard", "web/00001")
    sha = a.s3.head_object(Bucket=s3, Key=name)["Metadata"]["sha256"]
    a.s3.put_object(Bucket=s3, Key=name, Body=b"bad bytes!", Metadata={"sha256": sha})
    with pytest.raises(  # a transfer error: a job that meets it ends as a fault, retried, not as the user's to fix
        TransferError, match=f"shards/raw/web/00001.parquet: checksum mismatch after download \\(expected {sha}"
    ):
        b.fetch("raw_shard", "web/00001")
    assert [p for p in (tmp_path / "b").rglob("*") if p.is_file()] == []  # neither the file nor its temporary

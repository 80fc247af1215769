"""The artifact store: every artifact by kind and key, atomic writes, listing by key prefix."""

from __future__ import annotations

import os
import time

import pytest

from ghostvis_core.errors import GhostvisError
from ghostvis_core.store import LAYOUT, LocalStore, open_store


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


def test_open_store_takes_paths_and_file_uris_and_refuses_what_it_cannot_reach(tmp_path):
    assert open_store(str(tmp_path)).root == tmp_path
    assert open_store(tmp_path.as_uri()).root == tmp_path
    with pytest.raises(GhostvisError, match="s3://b/p: only local and shared-filesystem folders"):
        open_store("s3://b/p")

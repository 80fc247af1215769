"""A shard revised upstream costs one shard: `ghostvis data` tokenizes the new version alone, with the tokenizer
already trained; the tokenizer and the stages that trained the old version show stale naming the shard and
both sha256, and the old runs still audit clean on the version they read."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ghostvis_core.data.catalog import recorded_sha256
from ghostvis_core.data.ledger import Ledger
from ghostvis_core.home import Home
from ghostvis_core.plan.stages import stage_names
from ghostvis_core.runs.launch_spec import saved_shard_versions, saved_spec
from ghostvis_core.runs.lookup import completed_runs
from ghostvis_core.store.files import sha256_file
from tests.conftest import run_cli

SHARD = "demo_prose/00001"


def revise_upstream(home: Home, shard_id: str, folder) -> str:
    """The shard published again under its name with other content (every text reversed), its manifest entry
    pinning the new file's size and sha256, as shard_manifest lists a revised source: the new sha256."""
    source, name = shard_id.split("/")
    revised = folder / f"{name}.parquet"
    table = pq.read_table(home.store.fetch("raw_shard", shard_id))
    texts = pa.array([t[::-1] for t in table.column("text").to_pylist()])
    pq.write_table(table.set_column(table.schema.get_field_index("text"), "text", texts), revised)
    manifest = home.store.read_json("manifest", source)
    [entry] = [e for e in manifest["shards"] if e["name"] == name]
    entry.update(url=revised.as_uri(), bytes=revised.stat().st_size, sha256=sha256_file(revised))
    home.store.write_json("manifest", source, data=manifest)
    return entry["sha256"]


def token_files(home: Home) -> dict[tuple[str, str, str], int]:
    """Every token file the ledger records, (tokenizer, shard, content sha256) -> its mtime_ns."""
    rows = Ledger.in_store(home.store).shards(every_version=True)
    return {(r.tokenizer_id, r.shard_id, r.content_sha256): os.stat(r.token_path).st_mtime_ns for r in rows}


def stale_reasons(home_path) -> dict[str, list[str]]:
    """`ghostvis status --json`: asset -> why it is stale, without "its code changed" (other work in the tree)."""
    rows = json.loads(run_cli(["ghostvis", "status", "--json"], home_path).stdout)
    out = {r["asset"]: [x for x in r["reasons"] if "its code changed" not in x] for r in rows if r["state"] == "stale"}
    return {asset: reasons for asset, reasons in out.items() if reasons}


@pytest.mark.e2e
def test_an_upstream_revision_of_one_shard_is_tokenized_alone_with_the_kept_tokenizer(home_copy, tmp_path):
    h = Home(home_copy)
    runs = {s: completed_runs(h.store, s)[-1].run_key for s in stage_names()}
    tokenizer_id = saved_spec(h.store, "pretrain", runs["pretrain"])["tokenizer_id"]
    readers = sorted(s for s, key in runs.items() if SHARD in saved_shard_versions(saved_spec(h.store, s, key)))
    assert "pretrain" in readers and len(readers) < len(runs)
    tokenizers, before = h.store.keys("tokenizer"), token_files(h)
    old = recorded_sha256(h.store, SHARD)
    new = revise_upstream(h, SHARD, tmp_path)

    out = run_cli(["ghostvis", "data", "--preset", "smoke"], home_copy).stdout
    change = f"{SHARD} (sha256 {old} -> {new})"
    assert f"tokenizer: its training data changed since {tokenizer_id} was trained: {change}. It is kept" in out
    assert not [line for line in out.splitlines() if line.split()[:1] == ["tokenizer"]], out  # not materialized
    assert h.store.keys("tokenizer") == tokenizers
    after = token_files(h)
    assert set(after) - set(before) == {(tokenizer_id, SHARD, new)}  # exactly one shard tokenized
    assert {k: after[k] for k in before} == before  # every other token file untouched, the old version's kept

    stale = stale_reasons(home_copy)
    assert stale["tokenizer"] == [
        f"its training data changed since {tokenizer_id} was trained: {change}. It is kept (tokenized_shards "
        "tokenize the new versions with it); to train a new one on the current shards, materialize tokenizer "
        "(`ghostvis data --retrain-tokenizer`): every shard is then tokenized again and every stage is stale"
    ]
    assert "tokenized_shards" not in stale and "token_ledger" not in stale
    for s in stage_names():
        named = [f"run {runs[s]} trained on shards revised since: {change}"] if s in readers else []
        assert stale[s][0].startswith("input token_ledger changed (data version "), (s, stale[s])
        assert not any("input tokenizer" in r for r in stale[s]) and stale[s][1:] == named, (s, stale[s])

    audit = run_cli(["ghostvis", "audit", "--stage", "pretrain"], home_copy, check=False, timeout=900)
    assert audit.returncode == 0, audit.stdout[-3000:]  # the old run reads the old version's token files

"""Cross-shard MinHash dedup (ghostvis_core/data/dedup.py) through the real Dagster assets and checks: three
small shards of a source of your own with planted exact and near duplicates across shards, tokenized with
`dedup: {web: minhash}`. Exactly the planted rows are removed (the first occurrence in shard order is
kept), the ledger counts them as `minhash_dup` with the tokens a recount gives, and the token_ledger
check `removed_tokens_reconcile` (tokens before = kept + removed) passes, and fails on a planted wrong
count. A shard that arrives later is deduped against the earlier ones, which keep their tokens."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from dagster import DagsterInstance

from ghostvis_core.data.bpe_tokenizer import load_tokenizer
from ghostvis_core.data.catalog import load_manifest, record_raw_shard, save_manifest
from ghostvis_core.data.dedup import (
    Removal,
    RemovedRows,
    check_dedup_config,
    dedup_indexes,
    removed_rows,
    survivors_first,
)
from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.shard_manifest import ShardEntry
from ghostvis_core.data.tokenize_shards import job_for_shard
from ghostvis_core.errors import GhostvisError
from ghostvis_core.home import Home
from ghostvis_core.store import FolderStore
from ghostvis_core.store.files import sha256_file
from ghostvis_core.verify.audit.removed import removed_tokens_reconcile
from ghostvis_core.verify.audit.token_files import TokenFile
from ghostvis_pipeline.definitions import defs
from ghostvis_pipeline.demo import materialize
from tests.conftest import copy_home
from tests.raw_shards import tokenize_here

pytestmark = pytest.mark.e2e

VOCAB = [
    f"{a}{b}"
    for a in ("ka", "lo", "mi", "nu", "pe", "ra", "si", "to", "vu", "ze")
    for b in ("bar", "cen", "dol", "fim", "gat", "hul", "jor", "kes", "lun", "mop", "nis", "pry")
]
SHARDS, DOCS = ["web/00000", "web/00001", "web/00002"], 8
# (shard, row) removed -> (shard, row) kept; "one word" = the same document with one word replaced
PLANTED = {
    ("web/00001", 2): ("web/00000", 1),  # exact copy
    ("web/00002", 5): ("web/00000", 4),  # one word changed
    ("web/00002", 1): ("web/00001", 6),
}  # one word changed
NEAR = {("web/00002", 5), ("web/00002", 1)}
PARTITIONS = ("web/00000", "web/00002")


def corpus_texts(rng: random.Random) -> dict[str, list[str]]:
    """Documents of 70-110 random words (unrelated ones share no 5-word shingle), then the planted copies."""
    texts = {
        sid: [" ".join(rng.choice(VOCAB) for _ in range(rng.randint(70, 110))) for _ in range(DOCS)] for sid in SHARDS
    }
    for (sid, row), (kept_sid, kept_row) in PLANTED.items():
        words = texts[kept_sid][kept_row].split()
        if (sid, row) in NEAR:
            words[len(words) // 2] = "changed"
        texts[sid][row] = " ".join(words)
    return texts


@pytest.fixture(scope="module")
def deduped(module_tmp) -> SimpleNamespace:
    """The own-data walk (a file:// listing) through the real assets and checks, in this process on an
    ephemeral Dagster instance (one import instead of one CLI process per asset), with dedup on."""
    root = module_tmp("dedup")
    texts = corpus_texts(random.Random(25))
    for sid, docs in texts.items():
        (root / "corpus" / "web").mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"text": docs}), root / "corpus" / f"{sid}.parquet")
    home = root / "home"
    sources = {
        "ops": {
            "shard_manifest": {
                "config": {"sources": [], "remote": [{"name": "web", "listing": (root / "corpus" / "web").as_uri()}]}
            }
        }
    }
    dedup = {"ops": {"tokenized_shards": {"config": {"dedup": {"web": "minhash"}, "workers": 1}}}}
    with pytest.MonkeyPatch.context() as env:
        for var in [k for k in os.environ if k.startswith(("GHOSTVIS_", "DAGSTER_"))]:
            env.delenv(var)
        env.setenv("GHOSTVIS_HOME", str(home))
        env.setenv("GHOSTVIS_PRESET", "smoke")
        instance = DagsterInstance.ephemeral()
        materialize(defs, instance, ["shard_manifest"], run_config=sources)
        materialize(defs, instance, ["raw_shards"], partition_range=PARTITIONS)
        materialize(defs, instance, ["tokenizer"])
        materialize(defs, instance, ["tokenized_shards"], partition_range=PARTITIONS, run_config=dedup)
        checks = materialize(defs, instance, ["token_ledger"]).checks
        store = Home(home).store
        ledger = Ledger.in_store(store)
        tok = load_tokenizer(ledger.shards()[0].tokenizer_id, store)
        yield SimpleNamespace(
            home=home, store=store, ledger=ledger, tok=tok, texts=texts, instance=instance, checks=checks
        )


def recount(tok, text: str) -> int:
    """A document's tokens as a text shard holds them: <|bos|> + its text."""
    return 1 + len(tok.enc.encode_ordinary(text))


def test_exactly_the_planted_duplicates_are_removed_first_occurrence_kept(deduped):
    (index,) = deduped.store.fetch("ledger_file", "dedup").glob("*.parquet")
    assert json.loads(pq.read_schema(index).metadata[b"ghostvis.shards"]) == SHARDS
    removals = pq.read_table(index).to_pylist()
    assert {(r["shard_id"], r["row"]): (r["kept_shard"], r["kept_row"]) for r in removals} == PLANTED
    assert {r["reason"] for r in removals} == {"minhash_dup"}
    content = {r.shard_id: r.content_sha256 for r in deduped.ledger.shards(tokenizer_id=deduped.tok.tokenizer_id)}
    for sid in SHARDS:
        path = deduped.store.fetch("token_shard", deduped.tok.tokenizer_id, sid, content[sid])
        kept = TokenFile(path, sid).rows.tolist()
        assert kept == [row for row in range(DOCS) if (sid, row) not in PLANTED], sid


def test_the_ledger_counts_the_removals_as_minhash_dup_with_their_recounted_tokens(deduped):
    records = {r.shard_id: r for r in deduped.ledger.shards(tokenizer_id=deduped.tok.tokenizer_id)}
    for sid in SHARDS:
        removed = [deduped.texts[sid][row] for s, row in PLANTED if s == sid]
        expected = {"minhash_dup": {"docs": len(removed), "tokens": sum(recount(deduped.tok, t) for t in removed)}}
        assert json.loads(records[sid].drop_reasons) == (expected if removed else {}), sid
        assert (records[sid].docs_dropped, records[sid].tokens_dropped) == (
            (len(removed), expected["minhash_dup"]["tokens"]) if removed else (0, 0)
        )
        assert records[sid].docs == DOCS - len(removed)


def test_the_reconcile_check_holds_per_shard_and_in_total(deduped):
    assert ("token_ledger", "removed_tokens_reconcile", True) in deduped.checks
    outcome = removed_tokens_reconcile(deduped.store, deduped.ledger, deduped.tok.tokenizer_id)
    before = sum(recount(deduped.tok, t) for docs in deduped.texts.values() for t in docs)
    removed = sum(recount(deduped.tok, deduped.texts[s][r]) for s, r in PLANTED)
    assert outcome.passed, outcome.failures
    f = outcome.figures
    assert (f["tokens_before"], f["tokens_removed_ledger"], f["tokens_removed_recount"]) == (before, removed, removed)
    assert f["tokens_kept"] == before - removed and f["docs_removed_recount"] == len(PLANTED)
    assert (f["shards_checked"], f["shards_disagreeing"]) == (len(SHARDS), 0)
    assert outcome.tables["disagreeing_shards"][1] == []  # only shards that disagree are listed: none


def test_a_wrong_removed_count_fails_the_check_in_dagster(deduped, tmp_path, monkeypatch):
    """The ledger record of web/00001 rewritten with one dropped token too many (its reasons agreeing)."""
    home = tmp_path / "home"
    copy_home(deduped.home, home)
    ledger = Ledger.in_store(Home(home).store)
    record = next(r for r in ledger.shards() if r.shard_id == "web/00001")
    reasons = json.loads(record.drop_reasons)
    reasons["minhash_dup"]["tokens"] += 1
    ledger.write_shard(
        dataclasses.replace(
            record,
            tokens_dropped=record.tokens_dropped + 1,
            drop_reasons=json.dumps(reasons),
            created_at=record.created_at + 1,
        )
    )
    outcome = removed_tokens_reconcile(Home(home).store, ledger, record.tokenizer_id)
    tokens = record.tokens_dropped
    assert not outcome.passed
    assert any(
        f"shard web/00001: ledger removed {tokens + 1} tokens, the raw rows missing from the token file "
        f"hold {tokens}" in f
        for f in outcome.failures
    ), outcome.failures
    assert (
        outcome.figures["tokens_before"]
        == outcome.figures["tokens_kept"] + outcome.figures["tokens_removed_ledger"] - 1
    )
    assert (outcome.figures["shards_checked"], outcome.figures["shards_disagreeing"]) == (len(SHARDS), 1)
    [row] = outcome.tables["disagreeing_shards"][1]
    assert (row[0], row[7], row[8]) == ("web/00001", tokens + 1, tokens)  # tokens removed: ledger, recount
    monkeypatch.setenv("GHOSTVIS_HOME", str(home))
    with pytest.raises(GhostvisError) as failed:  # the command's message: the check's failure lines
        materialize(defs, deduped.instance, ["token_ledger"])
    assert (
        f"  token_ledger: removed_tokens_reconcile: shard web/00001: ledger removed {tokens + 1} tokens, the raw "
        f"rows missing from the token file hold {tokens}"
    ) in str(failed.value)


def test_a_later_shard_is_deduped_against_the_earlier_ones_which_keep_their_tokens(deduped, tmp_path):
    """web/00003 arrives with a copy of web/00000 row 0: a new index over four shards removes it; the
    three tokenized shards are not redone; the same shards again reuse the index."""
    shutil.copytree(deduped.home / "store", tmp_path / "store")  # the home's folder store
    store = FolderStore(tmp_path / "store")
    path = store.writable("raw_shard", "web/00003")
    pq.write_table(pa.table({"text": [deduped.texts["web/00000"][0], "a short new document"]}), path)
    store.publish("raw_shard", "web/00003")
    manifest = load_manifest(store, "web")
    manifest.shards.append(ShardEntry("00003", path.as_uri(), "train", path.stat().st_size, sha256_file(path)))
    save_manifest(store, manifest)
    manifest = load_manifest(store, "web")
    record_raw_shard(store, manifest, "web/00003", sha256_file(path), path.stat().st_size)
    jobs = [job_for_shard(store, manifest, sid) for sid in [*SHARDS, "web/00003"]]
    logs = tmp_path / "logs"
    (index,) = dedup_indexes(
        store, {"web": "minhash"}, jobs, tokenizer_id=deduped.tok.tokenizer_id, filters={}, logging_dir=logs, workers=1
    )
    assert not index.reused and index.shards == [*SHARDS, "web/00003"] and index.removed == len(PLANTED) + 1
    removed = removed_rows(store, [index])
    assert removed == RemovedRows(store.uri, {"web": index.key})  # what each task unpickles: no shard's rows
    assert removed("web/00003") == {0: "minhash_dup"} and removed("web/00000") == {}
    assert removed("web/00002") == {row: "minhash_dup" for s, row in PLANTED if s == "web/00002"}
    reports = tokenize_here(jobs, store, deduped.tok.tokenizer_id, logs, removed=removed)
    assert [r.shard_id for r in reports if not r.skipped] == ["web/00003"]
    assert json.loads(reports[-1].drop_reasons) == {
        "minhash_dup": {"docs": 1, "tokens": recount(deduped.tok, deduped.texts["web/00000"][0])}
    }
    again = dedup_indexes(
        store, {"web": "minhash"}, jobs, tokenizer_id=deduped.tok.tokenizer_id, filters={}, logging_dir=logs, workers=1
    )
    assert again == []  # every shard is tokenized: no index is needed
    (reused,) = dedup_indexes(
        store, {"web": "minhash"}, jobs, tokenizer_id="another-tokenizer", filters={}, logging_dir=logs, workers=1
    )
    assert reused.reused and (reused.key, reused.shards, reused.removed) == (index.key, index.shards, index.removed)
    assert removed_tokens_reconcile(store, Ledger.in_store(store), deduped.tok.tokenizer_id).passed


def test_a_bad_dedup_config_is_refused_naming_the_fix(deduped):
    manifests = {"web": load_manifest(deduped.store, "web")}
    with pytest.raises(GhostvisError, match="unknown method 'simhash'; use one of minhash"):
        check_dedup_config({"web": "simhash"}, manifests)
    with pytest.raises(GhostvisError, match="source forum is not registered"):
        check_dedup_config({"forum": "minhash"}, manifests)
    manifests["web"].kind = "chat"
    with pytest.raises(GhostvisError, match="source web is a chat source"):
        check_dedup_config({"web": "minhash"}, manifests)


def test_the_first_document_in_shard_order_survives_whatever_order_the_cluster_merged_in():
    members = {7: [(1, 4), (2, 0), (0, 9)], 3: [(2, 5), (1, 8)]}
    assert survivors_first(members, SHARDS) == [
        Removal("web/00001", 4, "web/00000", 9),
        Removal("web/00002", 0, "web/00000", 9),
        Removal("web/00002", 5, "web/00001", 8),
    ]


def test_a_document_the_filters_drop_removes_no_duplicate(deduped, tmp_path):
    """With a filter dropping web/00000 row 4, its near copy web/00002 row 5 is the first occurrence left: kept."""
    shutil.copytree(deduped.home / "store", tmp_path / "store")  # the home's folder store
    store = FolderStore(tmp_path / "store")
    words = deduped.texts["web/00000"][4].split()
    middle = " ".join(words[len(words) // 2 - 1 : len(words) // 2 + 2])  # the copy has "changed" in the middle
    assert sum(middle in t for docs in deduped.texts.values() for t in docs) == 1
    manifest = load_manifest(store, "web")
    jobs = [job_for_shard(store, manifest, sid) for sid in SHARDS]
    (index,) = dedup_indexes(
        store,
        {"web": "minhash"},
        jobs,
        tokenizer_id="another-tokenizer",
        filters={"web": [f"regex_exclude={middle}"]},
        logging_dir=tmp_path / "logs",
        workers=1,
    )
    removed = removed_rows(store, [index])
    assert not index.reused and index.removed == len(PLANTED) - 1
    assert (removed("web/00001"), removed("web/00002")) == ({2: "minhash_dup"}, {1: "minhash_dup"})

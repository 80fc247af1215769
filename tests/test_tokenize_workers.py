"""Tokenization with more workers writes the same bytes: the same shards tokenized with 1 worker (in this
process) and with 2 worker processes give identical token files and identical ledger rows (all but the
records' created_at), drops and filters included. benchmarks/tokenize_throughput.py measures the speed."""

from __future__ import annotations

import json
import random
import shutil
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.tokenize import TokenizeJob, tokenize_shards
from ghostvis_core.data.tokenizer import save_tokenizer, train_tokenizer
from ghostvis_core.store import FolderStore
from ghostvis_core.store.files import sha256_file

WORDS = "amber basil cedar dune ember fjord grove heath inlet juniper knoll larch marsh nettle".split()
FILTERS = {"corp": ["regex_exclude=^too short$"]}  # a filtered document, counted in the ledger


def shard_texts(rng: random.Random, n_docs: int) -> list[str]:
    """Documents of random words, with the drops the writer counts: an empty one, an exact duplicate and
    one FILTERS excludes."""
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 120))) for _ in range(n_docs)]
    return docs + ["", docs[0], "too short"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> SimpleNamespace:
    """Five raw shards and a tokenizer in one store, copied twice, then tokenized with 1 and 2 workers."""
    root = tmp_path_factory.mktemp("tokenize_workers")
    rng = random.Random(5)
    texts = {f"corp/{i:05d}": shard_texts(rng, 30 + 10 * i) for i in range(5)}
    source = FolderStore(root / "source")
    tok = train_tokenizer([t for docs in texts.values() for t in docs], 300)
    save_tokenizer(tok, source)
    jobs = []
    for shard_id, docs in texts.items():
        path = source.writable("raw_shard", shard_id)
        pq.write_table(pa.table({"text": docs}), path)
        source.publish("raw_shard", shard_id)
        jobs.append(TokenizeJob(shard_id, "corp", "train", sha256_file(path), "text"))
    stores, reports = {}, {}
    for workers in (1, 2):
        shutil.copytree(root / "source", root / f"{workers}w")
        stores[workers] = FolderStore(root / f"{workers}w")
        reports[workers] = tokenize_shards(
            jobs,
            store=stores[workers],
            tokenizer_id=tok.tokenizer_id,
            logging_dir=root / f"logs-{workers}w",
            workers=workers,
            filters=FILTERS,
        )
    return SimpleNamespace(stores=stores, reports=reports, tok=tok, jobs=jobs)


def ledger_rows(store: FolderStore) -> dict[str, list[dict]]:
    """Every ledger file's rows by its path in the ledger, without the time a record was written."""
    root = Ledger.in_store(store).root
    return {
        p.relative_to(root).as_posix(): [
            {k: v for k, v in row.items() if k != "created_at"} for row in pq.read_table(p).to_pylist()
        ]
        for p in sorted(root.rglob("*.parquet"))
    }


def test_two_workers_write_the_token_files_of_one_worker(runs):
    tid = runs.tok.tokenizer_id
    assert sorted(runs.stores[2].keys("token_shard")) == sorted(runs.stores[1].keys("token_shard"))
    assert len(runs.stores[1].keys("token_shard")) == len(runs.jobs)
    for job in runs.jobs:
        one = runs.stores[1].fetch("token_shard", tid, job.shard_id).read_bytes()
        two = runs.stores[2].fetch("token_shard", tid, job.shard_id).read_bytes()
        assert two == one, f"token shard {job.shard_id} differs between 1 and 2 workers"


def test_two_workers_write_the_ledger_rows_of_one_worker(runs):
    one, two = ledger_rows(runs.stores[1]), ledger_rows(runs.stores[2])
    assert two == one
    shards = [rows[0] for name, rows in one.items() if rows and "tokenizer_id" in rows[0]]
    assert sorted(r["shard_id"] for r in shards) == [j.shard_id for j in runs.jobs]
    for r in shards:  # each shard dropped its empty, duplicate and filtered document, and counted them
        assert r["docs_dropped"] == 3 and r["tokens"] > 0
        assert set(json.loads(r["drop_reasons"])) == {"empty_text", "exact_duplicate", "regex_exclude"}


def test_the_reports_match(runs):
    def figures(reports):
        return [
            (r.shard_id, r.skipped, r.docs, r.tokens, r.text_bytes, r.docs_dropped, r.tokens_dropped, r.drop_reasons)
            for r in reports
        ]

    assert figures(runs.reports[2]) == figures(runs.reports[1])
    assert [r.docs for r in runs.reports[1]] == [30 + 10 * i for i in range(5)]

"""Tokenization with more workers writes the same bytes: the same shards tokenized with 1 worker (in this
process) and with 2 worker processes give identical token files and identical ledger rows (all but the
records' created_at), drops and filters included. benchmarks/tokenize_throughput.py measures the speed."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ghostvis_core.data.bpe_tokenizer import Tokenizer, save_tokenizer, train_tokenizer
from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.tokenize_shards import TokenizeJob, TokenizeReport, tokenize_shards
from ghostvis_core.store import FolderStore
from tests.raw_shards import raw_shard_job

WORDS = "amber basil cedar dune ember fjord grove heath inlet juniper knoll larch marsh nettle".split()
FILTERS = {"corp": ["regex_exclude=^too short$"]}  # a filtered document, counted in the ledger


def shard_texts(rng: random.Random, n_docs: int) -> list[str]:
    """Documents of random words, with the drops the writer counts: an empty one, an exact duplicate and
    one FILTERS excludes."""
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 120))) for _ in range(n_docs)]
    return docs + ["", docs[0], "too short"]


def five_raw_shards(root: Path) -> tuple[Tokenizer, list[TokenizeJob]]:
    """Five raw shards and a tokenizer in a folder store at root/source: (the tokenizer, the shards' jobs)."""
    rng = random.Random(5)
    texts = {f"corp/{i:05d}": shard_texts(rng, 30 + 10 * i) for i in range(5)}
    source = FolderStore(root / "source")
    tok = train_tokenizer([t for docs in texts.values() for t in docs], 300)
    save_tokenizer(tok, source)
    return tok, [raw_shard_job(source, shard_id, pa.table({"text": docs})) for shard_id, docs in texts.items()]


def tokenize_a_copy(root: Path, tok: Tokenizer, jobs: list[TokenizeJob], workers: int):
    """Copy root/source to root/<workers>w and tokenize the copy with that many workers: (store, reports)."""
    shutil.copytree(root / "source", root / f"{workers}w")
    store = FolderStore(root / f"{workers}w")
    reports = tokenize_shards(
        jobs,
        store=store,
        tokenizer_id=tok.tokenizer_id,
        logging_dir=root / f"logs-{workers}w",
        workers=workers,
        filters=FILTERS,
    )
    return store, reports


def tokenize_five_shards(root: Path, workers: int) -> list[TokenizeReport]:
    return tokenize_a_copy(root, *five_raw_shards(root), workers)[1]


@pytest.fixture(scope="module")
def runs(module_tmp) -> SimpleNamespace:
    """Five raw shards and a tokenizer in one store, copied twice, then tokenized with 1 and 2 workers."""
    root = module_tmp("tokenize_workers")
    tok, jobs = five_raw_shards(root)
    stores, reports = {}, {}
    for workers in (1, 2):
        stores[workers], reports[workers] = tokenize_a_copy(root, tok, jobs, workers)
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
        one = runs.stores[1].fetch("token_shard", tid, job.shard_id, job.content_sha256).read_bytes()
        two = runs.stores[2].fetch("token_shard", tid, job.shard_id, job.content_sha256).read_bytes()
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


# A 2-worker tokenization in a process that ignores SIGTERM the way a Dagster step leaves it when the process was
# started with SIGINT ignored (in the background: nohup, CI): dagster/_utils/interrupts.py maps SIGTERM to SIGINT's
# disposition, and the pool's workers inherit it across the forkserver's exec.
IGNORING_SIGTERM = """
import random, signal, sys
from pathlib import Path
from dagster._utils.interrupts import setup_interrupt_handlers
from tests.test_tokenize_workers import tokenize_five_shards
signal.signal(signal.SIGINT, signal.SIG_IGN)
setup_interrupt_handlers()
assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
reports = tokenize_five_shards(Path(sys.argv[1]), workers=2)
print(sum(r.tokens for r in reports))
"""


def test_two_workers_end_in_a_process_that_ignores_sigterm(runs, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", IGNORING_SIGTERM, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.split()[-1]) == sum(r.tokens for r in runs.reports[2])

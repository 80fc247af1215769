"""Raw shards written into a store and tokenized in this process, for the data-path tests that need a
tokenized store without the Dagster assets (test_contamination, test_token_integrity, test_own_kinds,
test_tokenize_workers, test_dedup)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ghostvis_core.data.tokenize_shards import TokenizeJob, TokenizeReport, run_locally, tokenize_shards
from ghostvis_core.store import FolderStore
from ghostvis_core.store.files import sha256_file


def raw_shard_job(
    store: FolderStore, shard_id: str, table: pa.Table, split: str = "train", kind: str = "text"
) -> TokenizeJob:
    """`table` written and published as raw shard `shard_id` (source: the id's first part): the job
    that tokenizes it."""
    path = store.writable("raw_shard", shard_id)
    pq.write_table(table, path)
    store.publish("raw_shard", shard_id)
    return TokenizeJob(shard_id, shard_id.split("/")[0], split, sha256_file(path), kind)


def tokenize_here(
    jobs: list[TokenizeJob], store: FolderStore, tokenizer_id: str, logs: Path, **options
) -> list[TokenizeReport]:
    """tokenize_shards with datatrove's pipeline run in this process, one worker (`options`: filters,
    removed rows...): no worker processes to start, so a test pays seconds, not tens of seconds."""
    return tokenize_shards(
        jobs,
        store=store,
        tokenizer_id=tokenizer_id,
        logging_dir=logs,
        run_pipeline=lambda p, tasks, _w, logs: run_locally(p, tasks, 1, logs),
        **options,
    )

"""Tokenize raw Parquet shards into token shards and ledger rows, as a datatrove pipeline.

One datatrove task per shard; LocalPipelineExecutor fans the tasks out over worker processes
(the Slurm executor takes the same pipeline on a cluster). The reader keeps each document's raw
row index, so every token can be traced back to (shard, row).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from datatrove.data import Document
from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.readers import ParquetReader

from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.sources import sha256_file
from ghostvis_core.data.token_shard import TokenShard, token_dtype, write_token_shard
from ghostvis_core.data.tokenizer import load_tokenizer
from ghostvis_core.errors import GhostvisError

ENCODE_BATCH = 512


@dataclass(frozen=True)
class TokenizeJob:
    """One raw shard to tokenize (one datatrove task)."""

    shard_id: str
    source: str
    split: str
    raw_path: str
    token_path: str


class RawShardReader(ParquetReader):
    """datatrove's Parquet reader, reading only `text` and recording each document's raw row."""

    name = "📒 GhostVis raw shard"

    def __init__(self, jobs: list[TokenizeJob]):
        self.jobs = jobs
        super().__init__("/", read_metadata=False, batch_size=2048)

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        job = self.jobs[rank]
        try:
            pf = pq.ParquetFile(job.raw_path)
            if "text" not in pf.schema_arrow.names:
                raise GhostvisError(
                    f"raw shard {job.shard_id} ({job.raw_path}): no `text` column (columns: "
                    f"{', '.join(pf.schema_arrow.names)}); the source must be FineWeb-style Parquet"
                )
            row = 0
            for batch in pf.iter_batches(batch_size=self.batch_size, columns=["text"]):
                for text in batch.column(0).to_pylist():
                    self.stat_update("documents")
                    yield Document(text=text or "", id=f"{job.shard_id}#{row}", metadata={"row": row})
                    row += 1
        except GhostvisError:
            raise
        except Exception as exc:  # pyarrow raises several types for truncated/corrupt files
            raise GhostvisError(
                f"raw shard {job.shard_id} ({job.raw_path}) is unreadable: {exc}; delete it and "
                f"re-materialize raw_shards partition {job.shard_id}"
            ) from None


class TokenShardWriter(PipelineStep):
    """Encode documents (<|bos|> + ordinary tokens), write the token shard, then its ledger row."""

    name = "🔢 GhostVis tokenize"
    type = "🔢 - TOKENIZER"

    def __init__(self, jobs: list[TokenizeJob], tokenizer_dir: str, ledger_dir: str):
        super().__init__()
        self.jobs = jobs
        self.tokenizer_dir = tokenizer_dir
        self.ledger_dir = ledger_dir

    def run(self, data, rank: int = 0, world_size: int = 1):
        job = self.jobs[rank]
        tok = load_tokenizer(self.tokenizer_dir)
        encode = tok.enc.encode_ordinary
        dtype = token_dtype(tok.vocab_size)
        rows: list[int] = []
        lengths: list[int] = []
        flat: list[int] = []
        text_bytes = 0
        dropped = {}
        batch: list[Document] = []

        def flush() -> None:
            nonlocal text_bytes
            for doc in batch:
                ids = encode(doc.text)
                flat.append(tok.bos)
                flat.extend(ids)
                lengths.append(len(ids) + 1)
                rows.append(doc.metadata["row"])
                text_bytes += len(doc.text.encode("utf-8"))
            batch.clear()

        for doc in data:
            if not doc.text:
                d = dropped.setdefault("empty_text", {"docs": 0, "tokens": 0})
                d["docs"] += 1
                continue
            batch.append(doc)
            if len(batch) >= ENCODE_BATCH:
                flush()
        flush()
        values = np.array(flat, dtype=dtype)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        write_token_shard(Path(job.token_path), np.array(rows, dtype=np.int64), offsets, values)
        self.stat_update("tokens", value=int(offsets[-1]))
        raw = Path(job.raw_path)
        Ledger(Path(self.ledger_dir)).write_shard({
            "shard_id": job.shard_id, "source": job.source, "split": job.split,
            "content_sha256": sha256_file(raw), "raw_bytes": raw.stat().st_size,
            "tokenizer_id": tok.tokenizer_id, "docs": len(lengths), "tokens": int(offsets[-1]),
            "text_bytes": text_bytes, "docs_dropped": sum(d["docs"] for d in dropped.values()),
            "tokens_dropped": sum(d["tokens"] for d in dropped.values()),
            "drop_reasons": json.dumps(dropped, sort_keys=True), "token_path": job.token_path,
        })
        return
        yield  # a datatrove step is a generator; this one consumes and writes, yielding nothing


def is_done(job: TokenizeJob, ledger: Ledger, tokenizer_id: str, content_sha256: str) -> bool:
    """Same content and tokenizer already tokenized, with the token file intact: nothing to redo."""
    rec = ledger.shard_record_path(job.shard_id, tokenizer_id, content_sha256)
    if not rec.exists() or not Path(job.token_path).exists():
        return False
    rows = pq.read_table(rec).to_pylist()
    try:
        return TokenShard.open(Path(job.token_path), job.shard_id).num_tokens == rows[0]["tokens"]
    except GhostvisError:
        return False


@dataclass(frozen=True)
class TokenizeReport:
    shard_id: str
    skipped: bool
    docs: int
    tokens: int
    text_bytes: int
    seconds: float


def tokenize_shards(
    jobs: list[TokenizeJob],
    *,
    tokenizer_dir: Path,
    ledger_dir: Path,
    logging_dir: Path,
    workers: int = 2,
) -> list[TokenizeReport]:
    """Tokenize the jobs that are not already done; return one report per job (from the ledger)."""
    tok = load_tokenizer(str(tokenizer_dir))
    ledger = Ledger(ledger_dir)
    shas = {j.shard_id: sha256_file(Path(j.raw_path)) for j in jobs}
    todo = [j for j in jobs if not is_done(j, ledger, tok.tokenizer_id, shas[j.shard_id])]
    t0 = time.time()
    if todo:
        executor = LocalPipelineExecutor(
            pipeline=[RawShardReader(todo), TokenShardWriter(todo, str(tokenizer_dir), str(ledger_dir))],
            tasks=len(todo),
            workers=max(1, min(workers, len(todo))),
            logging_dir=str(logging_dir),
            skip_completed=False,
        )
        executor.run()
    seconds = time.time() - t0
    reports = []
    todo_ids = {j.shard_id for j in todo}
    for j in jobs:
        rec = pq.read_table(ledger.shard_record_path(j.shard_id, tok.tokenizer_id, shas[j.shard_id])).to_pylist()[0]
        reports.append(TokenizeReport(j.shard_id, j.shard_id not in todo_ids, rec["docs"], rec["tokens"],
                                      rec["text_bytes"], round(seconds, 3)))
    return reports


def reports_to_dicts(reports: list[TokenizeReport]) -> list[dict]:
    return [asdict(r) for r in reports]

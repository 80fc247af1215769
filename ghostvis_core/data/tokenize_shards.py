"""Tokenize raw Parquet shards into token shards and ledger rows, as a datatrove pipeline.

One datatrove task per shard; LocalPipelineExecutor fans the tasks out over worker processes (run_locally),
each loading the run's tokenizer once (the Slurm executor takes the same pipeline on a cluster). The reader
keeps each document's raw row index, so every token can be traced back to (shard, row).
"""

from __future__ import annotations

import functools
import hashlib
import json
import signal
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from datatrove.data import Document
from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.filters import FineWebQualityFilter, LambdaFilter, RegexFilter
from datatrove.pipeline.filters.base_filter import BaseFilter, get_filter_result
from datatrove.pipeline.readers import ParquetReader

from ghostvis_core.data.bpe_tokenizer import Tokenizer, load_tokenizer
from ghostvis_core.data.catalog import raw_content, recorded_sha256, replaced_sha256, shard_split
from ghostvis_core.data.chat import IMAGE, as_messages, render_chat, render_prompt, render_replies, render_reply
from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.ledger.records import DocRow, NgramRow, ShardRecord
from ghostvis_core.data.ngrams import fingerprints, prompt_text, record_text
from ghostvis_core.data.schema import KIND_COLUMNS, check_shard_schema
from ghostvis_core.data.shard_manifest import Manifest
from ghostvis_core.data.token_shard import TokenShard, list_column, token_dtype, write_token_shard
from ghostvis_core.errors import GhostvisError
from ghostvis_core.store import Store, open_store
from ghostvis_core.store.files import atomic_write, sha256_file


@dataclass(frozen=True)
class TokenizeJob:
    """One raw shard to tokenize (one datatrove task)."""

    shard_id: str
    source: str
    split: str
    content_sha256: str  # of the raw file: it decides the split; the worker checks the file it reads has it
    kind: str = "text"
    replaces_sha256: str = ""  # the content of the shard's version before this one ("" for a first version)


def job_for_shard(store: Store, manifest: Manifest, shard_id: str) -> TokenizeJob:
    """The job for one downloaded raw shard: its split is catalog.shard_split of its content hash, the
    one raw_shards recorded when it downloaded and verified the file (hashed here only for shards
    downloaded before raw_shards kept records), so the launching host reads no raw file."""
    content_sha256 = recorded_sha256(store, shard_id)
    if content_sha256 is None:
        if not store.exists("raw_shard", shard_id):
            raise GhostvisError(
                f"raw shard {shard_id} is not downloaded; materialize raw_shards partition {shard_id} first"
            )
        content_sha256 = sha256_file(store.fetch("raw_shard", shard_id))
    return TokenizeJob(
        shard_id,
        manifest.source,
        shard_split(store, manifest, shard_id, content_sha256),
        content_sha256,
        manifest.kind,
        replaced_sha256(store, shard_id),
    )


@dataclass(frozen=True)
class JobsFile:
    """A run's jobs in one Arrow file, of which each datatrove task reads only its own row, memory-mapped.
    The pipeline's steps hold this (a path), not the list: the local executor pickles the pipeline for each
    of the N tasks, so steps holding all N jobs cost N^2. Indexed by rank like the list it stands for."""

    path: str
    count: int

    @classmethod
    def write(cls, jobs: list[TokenizeJob], path: Path) -> JobsFile:
        table = pa.Table.from_pylist([asdict(j) for j in jobs])
        path.parent.mkdir(parents=True, exist_ok=True)
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        return cls(str(path), len(jobs))

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, rank: int) -> TokenizeJob:
        with pa.memory_map(self.path) as source:
            row = pa.ipc.open_file(source).read_all().slice(rank, 1).to_pylist()
        if not row:
            raise GhostvisError(
                f"tokenization task {rank}: no such job in {self.path} ({self.count} jobs); "
                "re-materialize the partitions"
            )
        return TokenizeJob(**row[0])


def raw_file(store: Store, job: TokenizeJob) -> Path:
    """The raw shard a worker reads (fetched to its node): the version with the job's content."""
    return raw_content(store, job.shard_id, job.content_sha256)


class RawShardReader(ParquetReader):
    """datatrove's Parquet reader, reading only the columns the source kind needs and recording
    each document's raw row, so every token can be traced to (shard, row)."""

    name = "📒 GhostVis raw shard"

    def __init__(self, jobs: Sequence[TokenizeJob], store_uri: str):
        self.jobs = jobs  # a JobsFile in tokenize_shards: each task reads its own job
        self.store_uri = store_uri  # workers may run on other nodes: they open the store from its URI
        super().__init__("/", read_metadata=False, batch_size=2048)

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        job = self.jobs[rank]
        columns = KIND_COLUMNS[job.kind]
        raw_path = raw_file(open_store(self.store_uri), job)
        check_shard_schema(job.shard_id, job.kind, raw_path)  # also a shard downloaded before raw_shards checked it
        try:
            pf = pq.ParquetFile(raw_path)
            present = [c for c in columns if c in pf.schema_arrow.names]
            row = 0
            for batch in pf.iter_batches(batch_size=self.batch_size, columns=present):
                if job.kind == "text":
                    for text in batch.column(0).to_pylist():
                        yield Document(text=text or "", id=f"{job.shard_id}#{row}", metadata={"row": row})
                        row += 1
                    continue
                for record in batch.to_pylist():
                    yield Document(
                        text=_record_text(job.kind, record),
                        id=f"{job.shard_id}#{row}",
                        metadata={"row": row, "record": record},
                    )
                    row += 1
        except GhostvisError:
            raise
        except Exception as exc:  # pyarrow raises several types for truncated/corrupt files
            raise GhostvisError(
                f"raw shard {job.shard_id} ({raw_path}) is unreadable: {exc}; delete it and "
                f"re-materialize raw_shards partition {job.shard_id}"
            ) from None


def _record_text(kind: str, record: dict) -> str:
    """The text a document filter reads: a preference pair's or problem's prompt, else record_text."""
    return prompt_text(record["prompt"]) if kind in ("preference", "problem") else record_text(kind, record)


def encode_document(tok: Tokenizer, kind: str, doc: Document) -> dict:
    """One document's token-shard columns (`tokens` always; kind-specific extras). Text documents
    are encoded straight into a uint32 buffer (no Python int list)."""
    if kind == "text":
        ids = tok.enc.encode_to_numpy(doc.text, disallowed_special=())
        return {"tokens": np.concatenate((np.array([tok.bos], ids.dtype), ids))}
    record = doc.metadata["record"]
    if kind == "chat":
        ids, mask = render_chat(tok, record["messages"])
        return {"tokens": ids, "mask": mask, "image": record.get("image")}
    if kind == "preference":
        prompt = render_prompt(tok, as_messages(record["prompt"]))
        chosen, rejected = render_replies(tok, record["chosen"]), render_replies(tok, record["rejected"])
        return {"tokens": prompt + chosen + rejected, "prompt_len": len(prompt), "chosen_len": len(chosen)}
    if kind == "problem":  # the prompt, then its answer as the reply (held back from the policy by prompt_len)
        prompt = render_prompt(tok, as_messages(record["prompt"]))
        return {"tokens": prompt + render_reply(tok, record["answer"]), "prompt_len": len(prompt)}
    ids = [tok.bos, tok.special(IMAGE), *tok.encode(record["caption"]), tok.eot]
    return {"tokens": ids, "image": record["image"]}


class TokenShardWriter(PipelineStep):
    """Encode documents, write the token shard, then its ledger row.

    A shard that fails (corrupt file, wrong schema) leaves its reason in errors_dir instead of
    stopping the other shards' tasks; tokenize_shards reports all failures once they are done.
    """

    name = "🔢 GhostVis tokenize"
    type = "🔢 - TOKENIZER"

    def __init__(self, jobs: Sequence[TokenizeJob], store_uri: str, tokenizer_id: str, errors_dir: str):
        super().__init__()
        self.jobs = jobs
        self.store_uri = store_uri  # workers are other processes: they open the store from its URI or path
        self.tokenizer_id = tokenizer_id
        self.errors_dir = errors_dir

    def run(self, data, rank: int = 0, world_size: int = 1):
        job = self.jobs[rank]
        try:
            self.tokenize(job, data)
        except Exception as exc:
            reason = (
                str(exc) if isinstance(exc, GhostvisError) else f"shard {job.shard_id}: {type(exc).__name__}: {exc}"
            )
            atomic_write(error_file(Path(self.errors_dir), job.shard_id), reason)
        return
        yield  # a datatrove step is a generator; this one consumes and writes, yielding nothing

    def tokenize(self, job: TokenizeJob, data) -> None:
        store = open_store(self.store_uri)
        tok = run_tokenizer(self.store_uri, self.tokenizer_id)
        dtype = token_dtype(tok.vocab_size)
        lists: dict[str, tuple[list[int], list]] = {}  # column -> (lengths, chunks of values)
        scalars: dict[str, list] = {}
        dropped: dict[str, dict[str, int]] = {}
        rows, doc_hashes, doc_ngrams = [], [], []  # per kept document: its row, doc_hash, winnowed 13-gram hashes
        text_bytes, seen = 0, set()  # the kept documents' UTF-8 bytes; their duplicate keys
        for doc in data:
            reason = doc.metadata.get("dropped")
            raw = doc.text.encode("utf-8")
            digest = doc_hash(job.kind, raw, doc)
            key = duplicate_key(job.kind, digest, doc)
            if reason is None and not raw:
                reason = "empty_text"
            elif reason is None and key in seen:
                reason = "exact_duplicate"
            if reason is not None:  # counted with its tokens, so the ledger explains raw vs trained
                tokens = len(encode_document(tok, job.kind, doc)["tokens"]) if raw else 0
                d = dropped.setdefault(reason, {"docs": 0, "tokens": 0})
                d["docs"], d["tokens"] = d["docs"] + 1, d["tokens"] + tokens
                continue
            seen.add(key)
            for col, value in encode_document(tok, job.kind, doc).items():
                if isinstance(value, (list, np.ndarray)):
                    lengths, chunks = lists.setdefault(col, ([], []))
                    lengths.append(len(value))
                    chunks.append(np.asarray(value, np.uint32))
                else:
                    scalars.setdefault(col, []).append(value)
            rows.append(doc.metadata["row"])
            doc_hashes.append(digest)
            doc_ngrams.append(sorted(fingerprints(ngram_text(job.kind, doc))))
            text_bytes += len(raw)
        columns = token_columns(rows, lists, scalars, dtype)
        n_tokens = sum(lists.get("tokens", ([], []))[0])
        token_file = store.writable("token_shard", tok.tokenizer_id, job.shard_id, job.content_sha256)
        write_token_shard(token_file, columns, tok.tokenizer_id)
        store.publish("token_shard", tok.tokenizer_id, job.shard_id, job.content_sha256)  # before its record names it
        self.stat_update("tokens", value=n_tokens, unit="shard")
        write_documents(ledger := Ledger.in_store(store), job, rows, doc_hashes, doc_ngrams)
        ledger.write_shard(
            ShardRecord(
                **asdict(job),  # the shard, its split, kind and the contents of this version and the one before
                raw_bytes=raw_file(store, job).stat().st_size,
                tokenizer_id=tok.tokenizer_id,
                docs=len(rows),
                tokens=n_tokens,
                text_bytes=text_bytes,
                docs_dropped=sum(d["docs"] for d in dropped.values()),
                tokens_dropped=sum(d["tokens"] for d in dropped.values()),
                drop_reasons=json.dumps(dropped, sort_keys=True),
                token_path=str(token_file),
            )
        )


def token_columns(rows: list[int], lists: dict[str, tuple[list[int], list]], scalars: dict[str, list], dtype) -> dict:
    """A token file's Arrow columns: the row numbers, each list column (tokens, mask, ...) flattened with
    its lengths, each scalar column; an empty shard still has its tokens column."""
    columns = {"row": pa.array(rows, pa.int64())}
    for col, (lengths, chunks) in lists.items():
        flat = np.concatenate(chunks) if chunks else np.zeros(0, np.uint32)
        columns[col] = list_column(lengths, flat, np.uint8 if col == "mask" else dtype)
    for col, values in scalars.items():
        columns[col] = pa.array(values, pa.binary() if col == "image" else pa.int64())
    if "tokens" not in columns:
        columns["tokens"] = list_column([], [], dtype)
    return columns


def doc_hash(kind: str, text_utf8: bytes, doc: Document) -> str:
    """Exact-duplicate key: the document's UTF-8 text, plus the image bytes for documents that
    carry one (the same caption on another image is another document)."""
    h = hashlib.sha1(text_utf8)
    if kind != "text" and (image := doc.metadata["record"].get("image")):
        h.update(image)
    return h.hexdigest()


def duplicate_key(kind: str, digest: str, doc: Document) -> str:
    """What makes a document an exact duplicate inside a shard: its doc_hash, and for a preference pair
    also its chosen and rejected replies. Several pairs for one prompt are distinct records (as preference
    data usually comes) and all kept; only the same prompt, chosen and rejected is dropped. The ledger keeps
    the pair's doc_hash, its prompt's: the train/validation overlap check then finds a validation prompt
    with a pair in a train shard, so a validation prompt never trains."""
    if kind != "preference":
        return digest
    h = hashlib.sha1(digest.encode("ascii"))
    for reply in ("chosen", "rejected"):
        h.update(b"\0" + prompt_text(doc.metadata["record"][reply]).encode("utf-8"))
    return h.hexdigest()


def write_documents(
    ledger: Ledger, job: TokenizeJob, rows: list[int], hashes: list[str], ngrams: list[list[int]]
) -> None:
    """The shard's per-document ledger tables: doc hashes (exact duplicates, train/validation overlap)
    and 13-gram fingerprints (the decontamination gate), both keyed by the raw row."""
    shard = (job.shard_id, job.source, job.split, job.content_sha256)
    ledger.write_doc_hashes(job.shard_id, job.content_sha256, [DocRow(*shard, r, h) for r, h in zip(rows, hashes)])
    ledger.write_ngrams(
        job.shard_id,
        job.content_sha256,
        [NgramRow(*shard, row, h) for row, kept in zip(rows, ngrams) for h in kept],
    )


def ngram_text(kind: str, doc: Document) -> str:
    """The words a document is tokenized from, for its n-gram fingerprints: a text, a chat's messages,
    a caption (the document's text) or a preference pair's prompt, chosen and rejected replies."""
    return doc.text if kind == "text" else record_text(kind, doc.metadata["record"])


class CountedFilters(PipelineStep):
    """Runs datatrove document filters, but marks a rejected document (with the filter's name and
    reason) instead of dropping it, so the writer counts its docs and tokens in the ledger. `removed`
    (shard -> {row: reason}, called once per task) marks rows decided before the run: cross-shard
    duplicates (data/dedup.py RemovedRows)."""

    name = "🔻 GhostVis filters"
    type = "🔻 - FILTER"

    def __init__(
        self,
        filters: dict[str, list[str]],
        jobs: Sequence[TokenizeJob],
        removed: Callable[[str], dict[int, str]] | None = None,
    ):
        super().__init__()
        self.specs = filters
        self.jobs = jobs
        self.removed = removed

    def run(self, data, rank: int = 0, world_size: int = 1):
        filters = [(spec, build_filter(spec)) for spec in self.specs.get(self.jobs[rank].source, [])]
        removed = self.removed(self.jobs[rank].shard_id) if self.removed else {}
        for doc in data:
            for spec, f in filters:
                keep, why = get_filter_result(f.filter(doc))
                if not keep:
                    doc.metadata["dropped"] = f"{spec.split('=')[0]}:{why}" if why else spec.split("=")[0]
                    break
            if "dropped" not in doc.metadata and doc.metadata["row"] in removed:
                doc.metadata["dropped"] = removed[doc.metadata["row"]]
            yield doc


def build_filter(spec: str) -> BaseFilter:
    """A filter from its spec string: min_chars=N, max_chars=N, regex_exclude=PATTERN, fineweb_quality."""
    name, _, arg = spec.partition("=")
    if name == "min_chars":
        return LambdaFilter(lambda d, n=int(arg): len(d.text) >= n)
    if name == "max_chars":
        return LambdaFilter(lambda d, n=int(arg): len(d.text) <= n)
    if name == "regex_exclude":
        return RegexFilter(arg)
    if name == "fineweb_quality":
        return FineWebQualityFilter()
    raise GhostvisError(
        f"unknown filter '{spec}'; use min_chars=N, max_chars=N, regex_exclude=PATTERN or fineweb_quality"
    )


def error_file(errors_dir: Path, shard_id: str) -> Path:
    return errors_dir / (shard_id.replace("/", "__") + ".txt")


def is_done(job: TokenizeJob, ledger: Ledger, store: Store, tokenizer_id: str) -> bool:
    """Same content and tokenizer already tokenized, with the token file intact and its block digests
    written: nothing to redo."""
    rec = ledger.shard_record_path(job.shard_id, tokenizer_id, job.content_sha256)
    if not rec.exists() or not store.exists("token_shard", tokenizer_id, job.shard_id, job.content_sha256):
        return False
    if not ledger.ngram_record_path(job.shard_id, job.content_sha256).exists():  # tokenized before the gate
        return False
    rows = pq.read_table(rec).to_pylist()
    try:
        token_file = store.fetch("token_shard", tokenizer_id, job.shard_id, job.content_sha256)
        shard = TokenShard.open(token_file, job.shard_id)
        return shard.blocks.digests is not None and shard.num_tokens == rows[0]["tokens"]
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
    docs_dropped: int = 0
    tokens_dropped: int = 0
    drop_reasons: str = "{}"
    content_sha256: str = ""  # the raw content tokenized: the shard's version
    replaces_sha256: str = ""  # the version before it ("": the first)


@functools.cache
def run_tokenizer(store_uri: str, tokenizer_id: str) -> Tokenizer:
    """The tokenizer of a run, loaded once per process: a worker parses its ranks for its first shard only."""
    return load_tokenizer(tokenizer_id, open_store(store_uri))


class LocalWorkers(LocalPipelineExecutor):
    """datatrove's local executor, whose pool workers stop when the pool tells them to. A worker inherits the
    signals its caller ignores (through the forkserver's exec). A Dagster step maps SIGTERM to SIGINT's handler
    (dagster/_utils/interrupts.py), so in a process started with SIGINT ignored (in the background: nohup, CI)
    SIGTERM is ignored too, and the pool's exit would wait forever for the workers it terminates."""

    def _launch_run_for_rank(self, rank: int, ranks_q, completed=None, completed_lock=None):
        if self.workers > 1:  # a pool worker: datatrove runs a single worker in the caller's own process
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        return super()._launch_run_for_rank(rank, ranks_q, completed, completed_lock)


def run_locally(pipeline: list, tasks: int, workers: int, logging_dir: Path) -> None:
    """datatrove worker processes on this machine, started by datatrove's default method (forkserver): each
    re-imports its modules (~1,000) before its first task. Forking them from the caller would save that, but
    the caller is often a Dagster step, and a forked worker inherits Dagster's signal handlers: when the pool
    stops its workers, a handler raises inside the worker's exit and the pool never joins (seen in the demo)."""
    LocalWorkers(
        pipeline=pipeline,
        tasks=tasks,
        workers=workers,
        logging_dir=str(logging_dir),
        skip_completed=False,
    ).run()


def raise_failures(todo: list[TokenizeJob], n_jobs: int, errors_dir: Path) -> None:
    """Every shard whose worker left an error file, in one error: the others are done and recorded."""
    failed = {
        j.shard_id: error_file(errors_dir, j.shard_id).read_text()
        for j in todo
        if error_file(errors_dir, j.shard_id).exists()
    }
    if failed:
        raise GhostvisError(
            f"{len(failed)} of {n_jobs} shards failed to tokenize ({n_jobs - len(failed)} others are done and "
            "recorded; a re-run skips them): " + " | ".join(failed.values())
        )


def tokenize_shards(
    jobs: list[TokenizeJob],
    *,
    store: Store,
    tokenizer_id: str,
    logging_dir: Path,
    workers: int = 2,
    filters: dict[str, list[str]] | None = None,
    run_pipeline: Callable[[list, int, int, Path], None] | None = None,
    removed: Callable[[str], dict[int, str]] | None = None,
) -> list[TokenizeReport]:
    """Tokenize the jobs that are not already done; return one report per job (from the ledger).
    The tokenizer is read from, and the ledger rows written to, `store`; each job names its token
    shard's file (in the store). `filters` maps a source to its document filters (see build_filter);
    `removed(shard_id)` names rows to drop with their reason (cross-shard duplicates: data/dedup.py).
    `run_pipeline(pipeline, tasks, workers, logging_dir)` runs the datatrove pipeline: worker processes
    here (`run_locally`), or a Slurm job array (ghostvis_core/launch/cluster/slurm_pipeline.py)."""
    for specs in (filters or {}).values():
        for spec in specs:
            build_filter(spec)  # fail on a bad spec before any work
    tok = run_tokenizer(store.uri, tokenizer_id)
    ledger = Ledger.in_store(store)
    todo = [j for j in jobs if not is_done(j, ledger, store, tok.tokenizer_id)]
    t0 = time.time()
    run_id = uuid.uuid4().hex[:8]
    errors_dir = logging_dir / "errors" / run_id
    if todo:
        todo_file = JobsFile.write(todo, logging_dir / "jobs" / f"{run_id}.arrow")  # beside datatrove's own files
        pipeline = [
            RawShardReader(todo_file, store.uri),
            CountedFilters(filters or {}, todo_file, removed),
            TokenShardWriter(todo_file, store.uri, tok.tokenizer_id, str(errors_dir)),
        ]
        (run_pipeline or run_locally)(pipeline, len(todo), max(1, min(workers, len(todo))), logging_dir)
        ledger = Ledger.in_store(store)  # the workers' rows (fetched again when the store is remote)
    seconds = time.time() - t0
    raise_failures(todo, len(jobs), errors_dir)
    reports = []
    todo_ids = {j.shard_id for j in todo}
    for j in jobs:
        rec = pq.read_table(ledger.shard_record_path(j.shard_id, tok.tokenizer_id, j.content_sha256)).to_pylist()[0]
        reports.append(
            TokenizeReport(
                j.shard_id,
                j.shard_id not in todo_ids,
                rec["docs"],
                rec["tokens"],
                rec["text_bytes"],
                round(seconds, 3),
                rec["docs_dropped"],
                rec["tokens_dropped"],
                rec["drop_reasons"],
                j.content_sha256,
                rec.get("replaces_sha256") or "",
            )
        )
    return reports

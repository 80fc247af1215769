"""The tokenizer as a job, launched by the `tokenizer` asset through the same launcher as training:

    python -m ghostvis_core.run.tokenizer_training --spec <store>/runs/tokenizer/<identity>/spec.json

Its spec says where the tokenizer comes from: trained (a byte-level BPE on the text sources' train shards, up
to the byte cap), taken from a Hugging Face model (`from_model`: the checkpoint's tokenizer.json, read by the
import code, which imports torch) or brought as a file (`from_file`: downloaded and built, e.g. a tiktoken BPE
file). The job saves it in the store and writes the identity record (identities/tokenizer/<identity>.json) with
its figures (and, trained, the shard lists), which the asset reads; a failure leaves its reason where the
launcher reads a rank's.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from ghostvis_core.data.bpe_tokenizer import Tokenizer, save_tokenizer, train_tokenizer
from ghostvis_core.data.brought_tokenizer import bring_tokenizer
from ghostvis_core.data.catalog import tokenizer_corpus
from ghostvis_core.errors import GhostvisError
from ghostvis_core.identity import digest
from ghostvis_core.run.track.pipes import PipesReporter
from ghostvis_core.runs.file_uri import split_run_uri
from ghostvis_core.runs.job_command import Job, job_parser
from ghostvis_core.runs.reasons import record_reason
from ghostvis_core.store import Store, lease, open_store
from ghostvis_core.store.fence import LeaseLost

FOLDER = "tokenizer"  # the jobs' folder in the store: runs/tokenizer/<identity>/
MODULE = "ghostvis_core.run.tokenizer_training"


@dataclass(frozen=True)
class TokenizerSpec:
    """Trained when neither from_model nor from_file is set (vocab_size and max_train_bytes then apply)."""

    key: str  # the tokenizer's identity (digest of `identity`): its record's name
    store: str  # the store's URI
    identity: dict  # trained: vocabulary, byte cap, the text shards by content and split; else where it comes from
    code_version: str  # the asset's, kept in the record
    vocab_size: int = 0
    max_train_bytes: int = 0
    from_model: str = ""  # a Hugging Face checkpoint (folder, s3://, hf://org/name@rev) whose tokenizer to take
    from_file: str = ""  # a tokenizer.json or tiktoken BPE file (path, s3://, http(s)://, hf://)
    special_tokens: dict[str, str] = field(default_factory=dict)  # GhostVis's markers -> the model's or file's text
    pattern: str = ""  # a tiktoken BPE file's split regex ("": cl100k's)


def brought_spec(store_uri: str, code_version: str, **where: Any) -> TokenizerSpec:
    """The spec of a tokenizer taken from a model or a file (`where`: from_model, or from_file and pattern, and
    special_tokens); its identity is where it comes from, so each place has its own record."""
    identity = {k: v for k, v in where.items() if v}
    return TokenizerSpec(digest(identity), store_uri, identity, code_version, **where)


def tokenizer_job(spec: TokenizerSpec) -> Job:
    """One rank; done when the identity record is written (also by an earlier launch of the identity, which a
    forced retraining or a tokenizer brought again overwrites)."""
    return Job(FOLDER, spec.key, MODULE, ranks=1, mlflow_tracking_uri="", done=("identity", FOLDER, spec.key))


def make(spec: TokenizerSpec, store: Store, log: Callable[[str], None]) -> dict:
    """Train, take or bring the tokenizer, save it, record it; the record's figures (the asset's metadata)."""
    if spec.from_model:
        md = from_model(spec, store, log)
    elif spec.from_file:
        md = from_file(spec, store, log)
    else:
        md = train(spec, store, log)
    record = {"identity": spec.identity, "code_version": spec.code_version, "metadata": md}
    commit_record(store, spec.key, json.dumps(record, indent=2, sort_keys=True))
    return md


def commit_record(store: Store, key: str, text: str) -> None:
    """The identity record, granted through the lease the tokenizer asset holds on the identity (store/fence.py):
    a job whose launch lost that lease (it was paused, another launch took over) removes its record and fails.
    A brought tokenizer is not leased: its record is written as it is."""
    store.write_text("identity", FOLDER, key, text=text)
    held = lease.join(store, FOLDER, key)
    if held is None:
        return
    try:
        held.commit("identity", FOLDER, key, text=text)
    except LeaseLost:
        store.delete("identity", FOLDER, key)
        raise


def train(spec: TokenizerSpec, store: Store, log: Callable[[str], None]) -> dict:
    """The BPE trained on the text train shards; its figures, with the shard lists."""
    corpus = tokenizer_corpus(store, spec.max_train_bytes)
    if not corpus.texts:
        raise GhostvisError("no downloaded text train shards to train the tokenizer on; materialize raw_shards first")
    log(
        f"tokenizer: {len(corpus.train_shard_ids)} train shards, "
        f"{len(corpus.validation_shard_ids)} validation shards left out"
    )
    t0 = time.time()
    tok = train_tokenizer(corpus.texts, spec.vocab_size)
    save_tokenizer(tok, store)
    md = {
        "tokenizer_id": tok.tokenizer_id,
        "vocab_size": tok.vocab_size,
        "train_shards": len(corpus.train_shard_ids),
        "train_shard_ids": corpus.train_shard_ids,
        "validation_shards_excluded": len(corpus.validation_shard_ids),
        "validation_shard_ids_excluded": corpus.validation_shard_ids,
        "train_bytes": corpus.train_bytes,
        "train_seconds": round(time.time() - t0, 2),
    }
    log(f"tokenizer: {tok.tokenizer_id} trained in {md['train_seconds']} s")
    return md


def from_model(spec: TokenizerSpec, store: Store, log: Callable[[str], None]) -> dict:
    """The Hugging Face checkpoint's tokenizer (the import code, which imports torch: here, not in Dagster)."""
    from ghostvis_core.run.hf.imports import import_tokenizer

    tok = import_tokenizer(store, spec.from_model, spec.special_tokens)
    log(f"tokenizer: {tok.tokenizer_id} is the tokenizer of {spec.from_model} (not trained)")
    return brought(tok, from_model=spec.from_model)


def from_file(spec: TokenizerSpec, store: Store, log: Callable[[str], None]) -> dict:
    """The tokenizer in a file, downloaded and built (a tiktoken BPE file's ranks, a tokenizer.json's merges)."""
    got = bring_tokenizer(spec.from_file, spec.special_tokens, spec.pattern)
    save_tokenizer(got.tokenizer, store)
    log(f"tokenizer: {got.tokenizer.tokenizer_id} from {spec.from_file} (sha256 {got.sha256}, not trained)")
    return brought(got.tokenizer, from_file=spec.from_file, source_sha256=got.sha256)


def brought(tok: Tokenizer, **source: str) -> dict:
    """The figures of a tokenizer taken from a model or a file: where from, what stands for each chat marker."""
    return {
        "tokenizer_id": tok.tokenizer_id,
        "vocab_size": tok.vocab_size,
        **source,
        "markers": dict(tok.markers),
        "train_shards": 0,
    }


def write_spec(spec: TokenizerSpec, store: Store) -> None:
    store.write_json("run_spec", FOLDER, spec.key, data=asdict(spec))


def main(argv: list[str] | None = None) -> int:
    ap = job_parser(MODULE, __doc__, "the tokenizer's spec, as the asset wrote it: its URI in the store")
    store_uri, folder, key, _ = split_run_uri(ap.parse_args(argv).spec)
    store, pipes = open_store(store_uri), PipesReporter(is_main=True)

    def log(message: str) -> None:
        print(message, flush=True)
        pipes.log(message)

    try:
        make(TokenizerSpec(**store.read_json("run_spec", folder, key)), store, log)
    except GhostvisError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        record_reason(store, folder, key, 0, str(exc))
        return 2
    finally:
        pipes.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

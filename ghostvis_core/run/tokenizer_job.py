"""Tokenizer training as a job, launched by the `tokenizer` asset through the same launcher as training:

    python -m ghostvis_core.run.tokenizer_job --spec <store>/runs/tokenizer/<identity>/spec.json

It reads the text sources' train shards (up to the byte cap), trains the byte-level BPE, saves it in the
store and writes the identity record (identities/tokenizer/<identity>.json) with its figures and the
shard lists, which the asset reads; a failure leaves its reason where the launcher reads a rank's.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from ghostvis_core.data.catalog import tokenizer_corpus
from ghostvis_core.data.tokenizer import save_tokenizer, train_tokenizer
from ghostvis_core.errors import GhostvisError
from ghostvis_core.run.job import Job
from ghostvis_core.run.run_files import split_run_uri
from ghostvis_core.run.track.pipes import PipesReporter
from ghostvis_core.run.train.reasons import record_reason
from ghostvis_core.store import Store, open_store

FOLDER = "tokenizer"  # the jobs' folder in the store: runs/tokenizer/<identity>/
MODULE = "ghostvis_core.run.tokenizer_job"


@dataclass(frozen=True)
class TokenizerSpec:
    key: str  # the tokenizer's identity (digest of `identity`): its record's name
    store: str  # the store's URI
    vocab_size: int
    max_train_bytes: int
    identity: dict  # vocabulary, byte cap, the text shards by content and split
    code_version: str  # the asset's, kept in the record


def tokenizer_job(spec: TokenizerSpec) -> Job:
    """One rank; done when the identity record is written (also by an earlier training of the identity,
    which a forced retraining overwrites)."""
    return Job(FOLDER, spec.key, MODULE, ranks=1, mlflow_tracking_uri="", done=("identity", FOLDER, spec.key))


def train(spec: TokenizerSpec, store: Store, log: Callable[[str], None]) -> dict:
    """Train, save, record; the record's figures (the asset's metadata, with the shard lists)."""
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
    record = {"identity": spec.identity, "code_version": spec.code_version, "metadata": md}
    store.write_json("identity", FOLDER, spec.key, data=record)
    return md


def write_spec(spec: TokenizerSpec, store: Store) -> None:
    store.write_json("run_spec", FOLDER, spec.key, data=asdict(spec))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__)
    ap.add_argument("--spec", required=True, help="the tokenizer's spec, as the asset wrote it: its URI in the store")
    store_uri, folder, key, _ = split_run_uri(ap.parse_args(argv).spec)
    store, pipes = open_store(store_uri), PipesReporter(is_main=True)

    def log(message: str) -> None:
        print(message, flush=True)
        pipes.log(message)

    try:
        md = train(TokenizerSpec(**store.read_json("run_spec", folder, key)), store, log)
        log(f"tokenizer: {md['tokenizer_id']} trained in {md['train_seconds']} s")
    except GhostvisError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        record_reason(store, folder, key, 0, str(exc))
        return 2
    finally:
        pipes.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Cross-shard near-duplicate removal (MinHash), an optional step before tokenization.

A source with `dedup: {web: minhash}` in tokenized_shards' config is indexed as a whole: datatrove's
MinHash stages (signature -> buckets -> cluster) run over every downloaded raw shard of the source, in
shard order, and of each cluster of near duplicates the first document in shard order (shard, then
row) is kept; every other one is a removal naming the document it duplicates. Tokenization then marks
the removed rows as dropped with the reason `minhash_dup` (CountedFilters), so the ledger's per-shard
`docs_dropped`, `tokens_dropped` and `drop_reasons` count them like any other drop.

The index is keyed by what it is made of (the source's shards by content hash, the MinHash settings,
the source's filters, this code) and kept in the store beside the ledger's tables
(`ledger/dedup/<key>.parquet`: each removed shard and row, the shard and row it duplicates, the
reason), so a re-run over the same shards reuses it. A shard already tokenized keeps the decision it was tokenized with:
its token file may already have been read by a training run. So a shard that arrives later is deduped
against the ones before it, but a document of an earlier shard that the new shard makes a duplicate
(through a chain of near duplicates) stays where it was tokenized.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.dedup.minhash import (
    MinhashConfig,
    MinhashDedupBuckets,
    MinhashDedupCluster,
    MinhashDedupSignature,
)
from datatrove.utils.hashing import HashConfig
from datatrove.utils.word_tokenizers import WordTokenizer

from ghostvis_core.data.catalog import recorded_sha256, registered_manifests
from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.ledger.files import write_parquet
from ghostvis_core.data.ledger.records import schema_of
from ghostvis_core.data.shard_manifest import Manifest
from ghostvis_core.data.tokenize_shards import (
    CountedFilters,
    JobsFile,
    RawShardReader,
    TokenizeJob,
    build_filter,
    is_done,
    job_for_shard,
    run_locally,
)
from ghostvis_core.errors import GhostvisError
from ghostvis_core.identity import code_version, digest
from ghostvis_core.store import Store, open_store

REASON = {"minhash": "minhash_dup"}  # method -> the drop reason its removals are counted under
# datatrove's defaults: 5-word shingles, 14 bands of 8 hashes (a pair at Jaccard 0.8 is found with p = 0.92);
# shingles hashed with sha1 (datatrove's xxhash path hands xxhash a str, which xxhash 4 refuses)
MINHASH = MinhashConfig(
    n_grams=5, num_buckets=14, hashes_per_bucket=8, seed=1, hash_config=HashConfig(precision=64, hash_fc="sha1")
)


@dataclass(frozen=True)
class Removal:
    """A document removed as a near duplicate of an earlier one (the kept one: kept_shard, kept_row)."""

    shard_id: str
    row: int
    kept_shard: str
    kept_row: int


# One row per removed document, in shard order (a Removal and the drop reason it is counted under); the file's
# metadata holds the index's identity and shards.
INDEX_SCHEMA = pa.schema([*schema_of(Removal), pa.field("reason", pa.string())])


@dataclass(frozen=True)
class DedupIndex:
    """One source's dedup index: the shards it was built on (in shard order) and how many documents it removes."""

    source: str
    method: str
    key: str
    shards: list[str]
    removed: int
    reused: bool


@dataclass(frozen=True)
class RemovedRows:
    """What tokenization drops as duplicates, per shard: a datatrove task calls it with its shard and
    reads only that shard's rows of its source's index, so the pipeline carries index keys, not every
    shard's rows (the local executor pickles the pipeline once per task)."""

    store_uri: str
    index_keys: dict[str, str]  # source -> index key

    def __call__(self, shard_id: str) -> dict[int, str]:
        key = self.index_keys.get(shard_id.split("/", 1)[0])
        if key is None:
            return {}
        path = open_store(self.store_uri).fetch("ledger_file", index_file(key))
        table = pq.read_table(path, columns=["row", "reason"], filters=[("shard_id", "=", shard_id)])
        return dict(zip(table.column("row").to_pylist(), table.column("reason").to_pylist()))


def index_file(key: str) -> str:
    """Where an index lives in the ledger folder (artifact kind ledger_file): queryable with the ledger's tables."""
    return f"dedup/{key}.parquet"


def removed_rows(store: Store, indexes: list[DedupIndex]) -> RemovedRows | None:
    """The rows tokenization drops for these indexes (None: no source is deduped in this run)."""
    return RemovedRows(store.uri, {ix.source: ix.key for ix in indexes}) if indexes else None


class SplitWords(WordTokenizer):
    """Words split on whitespace, after datatrove's own normalisation (lowercase, no punctuation):
    language-agnostic, and without spaCy, which datatrove's language tokenizers need."""

    def word_tokenize(self, text: str) -> list[str]:
        return text.split()

    def sent_tokenize(self, text: str) -> list[str]:
        return [text]

    def span_tokenize(self, text: str) -> list[tuple[int, int]]:
        return [(0, len(text))]


class BlankDropped(PipelineStep):
    """Empties the text of a document a filter dropped: it gets no MinHash signature, so it neither
    survives nor removes a duplicate, while the signature stage's document index stays its raw row."""

    name = "🫥 GhostVis blank dropped"
    type = "🔻 - FILTER"

    def run(self, data, rank: int = 0, world_size: int = 1):
        for doc in data:
            if doc.metadata.get("dropped"):
                doc.text = ""
            yield doc


def dedup_indexes(
    store: Store,
    dedup: dict[str, str],
    jobs: list[TokenizeJob],
    *,
    tokenizer_id: str,
    filters: dict[str, list[str]],
    logging_dir: Path,
    workers: int = 2,
) -> list[DedupIndex]:
    """The index of each source in `dedup` (source -> method) with a shard among `jobs` still to
    tokenize, built over every downloaded shard of that source (or reused from the store)."""
    manifests = registered_manifests(store)
    check_dedup_config(dedup, manifests)
    for source in dedup:
        for spec in filters.get(source, []):
            build_filter(spec)  # the index applies the source's filters first: a bad spec fails before any work
    ledger = Ledger.in_store(store)
    pending = {j.source for j in jobs if j.source in dedup and not is_done(j, ledger, store, tokenizer_id)}
    return [
        source_index(store, manifests[source], dedup[source], filters.get(source, []), logging_dir, workers)
        for source in sorted(pending)
    ]


def check_dedup_config(dedup: dict[str, str], manifests: dict[str, Manifest]) -> None:
    """Refuse an unknown method, an unregistered source or a source that is not text, before any work."""
    for source, method in dedup.items():
        if method not in REASON:
            raise GhostvisError(f"dedup: source {source}: unknown method '{method}'; use one of {', '.join(REASON)}")
        if source not in manifests:
            raise GhostvisError(
                f"dedup: source {source} is not registered (sources: {', '.join(manifests) or 'none'}); "
                "fix the name or materialize shard_manifest with it"
            )
        if manifests[source].kind != "text":
            raise GhostvisError(
                f"dedup: source {source} is a {manifests[source].kind} source; MinHash dedup "
                "compares plain text, so list only text sources under dedup"
            )


def source_index(
    store: Store, manifest: Manifest, method: str, filters: list[str], logging_dir: Path, workers: int
) -> DedupIndex:
    """The source's index over its downloaded shards: read from the store if one with the same identity
    was built, else built with datatrove and saved."""
    source = manifest.source
    shard_ids = [manifest.shard_id(e) for e in manifest.shards]
    jobs = [job_for_shard(store, manifest, sid) for sid in shard_ids if recorded_sha256(store, sid) is not None]
    identity = {
        "source": source,
        "method": method,
        "minhash": str(MINHASH),
        "seed": MINHASH.seed,
        "filters": filters,
        "shards": [[j.shard_id, j.content_sha256] for j in jobs],
        "code": code_version("ghostvis_core.data.dedup"),
    }
    key = digest(identity)
    if store.exists("ledger_file", index_file(key)):
        path = store.fetch("ledger_file", index_file(key))
        shards = json.loads(pq.read_schema(path).metadata[b"ghostvis.shards"])
        return DedupIndex(source, method, key, shards, pq.ParquetFile(path).metadata.num_rows, True)
    removals = minhash_removals(store, jobs, filters, logging_dir / key, workers)
    write_index(store, key, identity, [j.shard_id for j in jobs], removals, REASON[method])
    return DedupIndex(source, method, key, [j.shard_id for j in jobs], len(removals), False)


def write_index(
    store: Store, key: str, identity: dict, shards: list[str], removals: list[Removal], reason: str
) -> None:
    """The index as one Parquet file (temporary name, then rename; then published), its identity and
    shards in the file's metadata: a half-written index is never taken for one."""
    schema = INDEX_SCHEMA.with_metadata(
        {"ghostvis.identity": json.dumps(identity, sort_keys=True), "ghostvis.shards": json.dumps(shards)}
    )
    columns = {f.name: [getattr(r, f.name) for r in removals] for f in fields(Removal)}
    table = pa.table({**columns, "reason": [reason] * len(removals)}, schema=schema)
    write_parquet(store.writable("ledger_file", index_file(key)), table, schema)
    store.publish("ledger_file", index_file(key))


def minhash_removals(
    store: Store, jobs: list[TokenizeJob], filters: list[str], logging_dir: Path, workers: int
) -> list[Removal]:
    """datatrove's three MinHash stages over the shards (one signature task per shard, so a signature
    file's number is the shard's position in `jobs`), then the first-in-shard-order survivor per cluster.
    The signatures and buckets are scratch files beside the logs on this host, deleted afterwards."""
    work = logging_dir / "scratch"
    shutil.rmtree(work, ignore_errors=True)  # an interrupted build's
    try:
        tasks = JobsFile.write(jobs, work / "jobs.arrow")  # each task reads its own job, as in tokenize_shards
        signatures = [
            RawShardReader(tasks, store.uri),
            CountedFilters({jobs[0].source: filters}, tasks),
            BlankDropped(),
            MinhashDedupSignature(str(work / "signatures"), MINHASH, language=SplitWords()),
        ]
        run_locally(signatures, len(jobs), max(1, min(workers, len(jobs))), logging_dir / "signatures")
        buckets = [MinhashDedupBuckets(str(work / "signatures"), str(work / "buckets"), config=MINHASH)]
        run_locally(buckets, MINHASH.num_buckets, max(1, min(workers, MINHASH.num_buckets)), logging_dir / "buckets")
        clusters = [MinhashDedupCluster(str(work / "buckets"), str(work / "clusters"), MINHASH, save_cluster_id=True)]
        run_locally(clusters, 1, 1, logging_dir / "clusters")
        return survivors_first(cluster_members(work / "clusters"), [j.shard_id for j in jobs])
    finally:
        shutil.rmtree(work, ignore_errors=True)


def cluster_members(folder: Path) -> dict[int, list[tuple[int, int]]]:
    """cluster id -> its documents as (shard position, row), from MinhashDedupCluster's `.clusters`
    files (per shard: (row, cluster id) pairs of uint32)."""
    members: dict[int, list[tuple[int, int]]] = {}
    for path in sorted(folder.glob("*.clusters")):
        position = int(path.name.split(".")[0])
        for row, cluster in np.fromfile(path, dtype="<u4").reshape(-1, 2).tolist():
            members.setdefault(cluster, []).append((position, row))
    return members


def survivors_first(members: dict[int, list[tuple[int, int]]], shard_ids: list[str]) -> list[Removal]:
    """Per cluster, the first document in shard order is kept and every other one removed. (datatrove's
    own choice, its union-find root, depends on the order clusters merged; this one on the data only.)"""
    removals = []
    for docs in members.values():
        kept_position, kept_row = min(docs)
        removals += [
            Removal(shard_ids[p], row, shard_ids[kept_position], kept_row)
            for p, row in docs
            if (p, row) != (kept_position, kept_row)
        ]
    order = {sid: i for i, sid in enumerate(shard_ids)}
    return sorted(removals, key=lambda r: (order[r.shard_id], r.row))

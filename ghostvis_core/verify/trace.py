"""`ghostvis trace`: which stages, runs, steps and ranks trained a document, and which
documents a step fed.

Answered from the ledger alone: the audit's row index of each run (ghostvis_core/verify/audit/row_index.py:
every planned global row of its chain, with its step, rank, micro-batch and shard spans, rebuilt by the
audit's own row rule, never the trainer's code; one file per run, sorted by shard) is read where a
filter on shard and raw row can match. The one token file opened is the document's own (its token span
in the version each run read), and the raw shard only for a few characters of each document.
- a document (shard, raw row): every run's index rows whose spans cover its raw row and overlap its
  tokens, giving segment, step, rank, micro-batch, global row and epoch; then every run downstream of
  those (their lineage holds one) and, when an MLflow tracking URI is given, the model versions
  registered from them;
- a step of a run (default: the stage's newest completed run): its index rows of that step, with their
  shard spans and raw rows;
- a text: the documents of the ledger's current shards that hold the most of its 13-gram fingerprints
  (ghostvis_core/data/ngrams.py), each then traced as a document.
A run whose stage checks have not run yet (or whose chain grew since) has no index for its chain: it is
written the first time the run is traced.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from ghostvis_core.data.catalog import manifest_of_shard, recorded_sha256
from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.ledger.query import RunHead
from ghostvis_core.data.ngrams import TEXT_COLUMNS, fingerprints, normalize, record_text
from ghostvis_core.errors import GhostvisError
from ghostvis_core.runs.launch_spec import saved_shard_versions, saved_spec
from ghostvis_core.runs.lookup import completed, newest_completed_run, run_result
from ghostvis_core.store import Store
from ghostvis_core.verify.audit.row_index import write_row_index
from ghostvis_core.verify.audit.token_files import TokenFile

SNIPPET = 60  # characters of each document shown


def shard_row(value: str) -> tuple[str, int]:
    """A document named as <shard>:<raw row>."""
    shard_id, _, row = value.rpartition(":")
    if not shard_id or not row.isdigit():
        raise GhostvisError(f"document {value!r}: give <shard>:<row>, e.g. demo_prose/00000:12 (the raw shard's row)")
    return shard_id, int(row)


@dataclass
class Snippets:
    """The first characters of raw documents, each raw file's row group read once per answer."""

    store: Store
    _groups: dict[tuple[str, str | None, int], list[str]] = field(default_factory=dict)
    _kinds: dict[str, str] = field(default_factory=dict)  # source -> kind, its manifest read once

    def text(self, shard_id: str, row: int, content_sha256: str | None = None) -> str:
        """Raw row `row` of the shard, in the version with `content_sha256` when given (else the current one)."""
        current = content_sha256 is None or recorded_sha256(self.store, shard_id) == content_sha256
        path = (
            self.store.fetch("raw_shard", shard_id)
            if current
            else self.store.fetch("raw_shard_version", shard_id, content_sha256)
        )
        f = pq.ParquetFile(path)
        if not 0 <= row < f.metadata.num_rows:
            raise GhostvisError(
                f"document {shard_id}:{row}: the raw shard has rows 0-{f.metadata.num_rows - 1}; give one of them"
            )
        group = 0
        while row >= f.metadata.row_group(group).num_rows:
            row, group = row - f.metadata.row_group(group).num_rows, group + 1
        key = (shard_id, content_sha256, group)
        if key not in self._groups:
            source = shard_id.split("/", 1)[0]
            if source not in self._kinds:
                self._kinds[source] = manifest_of_shard(self.store, shard_id).kind
            kind = self._kinds[source]
            records = f.read_row_group(group, columns=TEXT_COLUMNS[kind]).to_pylist()
            self._groups[key] = [record_text(kind, r)[:SNIPPET].replace("\n", " ") for r in records]
        return self._groups[key][row]


def run_indexes(store: Store, ledger: Ledger) -> tuple[list[RunHead], list[Path]]:
    """Every run's head (`Ledger.run_heads`) and the row index file of its chain, written first where the
    run's checks have not written it or its chain grew since."""
    heads, files = ledger.run_heads(), []
    for h in heads:
        index = ledger.row_index_file(h.head)
        if not index.is_file():
            spec = saved_spec(store, h.stage, h.run_key)
            index = write_row_index(store, ledger, spec, ledger.chain(h.run_key))
        files.append(index)
    return heads, files


def trace_document(store: Store, ledger: Ledger, shard_id: str, row: int, tracking_uri: str | None = None) -> dict:
    """Every stage, run, segment, step, rank and epoch that trained raw row `row` of `shard_id`, the runs
    downstream of them and (with `tracking_uri`) the model versions registered from those."""
    text = Snippets(store).text(shard_id, row)  # also proves the document exists
    heads, files = run_indexes(store, ledger)
    by_run = defaultdict(list)
    for r in ledger.row_index(files, "shard_id = ? AND row_start <= ? AND ? < row_end", [shard_id, row, row]):
        by_run[(r.stage, r.run_key)].append(r)
    hits, spans = [], {}
    for (stage, key), rows in sorted(by_run.items()):
        spec = saved_spec(store, stage, key)
        file_key = (spec["tokenizer_id"], shard_id, saved_shard_versions(spec)[shard_id])
        if file_key not in spans:
            tf = TokenFile(store.fetch("token_shard", *file_key), shard_id)
            found = (tf.rows == row).nonzero()[0]
            spans[file_key] = tf.doc_span(int(found[0])) if len(found) else None  # None: tokenization dropped it
        if spans[file_key] is None:
            continue
        start, end = spans[file_key]
        seen = set()
        for r in rows:  # a span over the document's raw row reads its tokens, or only its neighbours'
            if r.tok_start < end and start < r.tok_end and (r.part_id, r.global_row) not in seen:
                seen.add((r.part_id, r.global_row))  # a row holding the document twice is one hit
                hits.append(
                    {"stage": stage, "run_key": key}
                    | {k: getattr(r, k) for k in ("segment", "epoch", "global_row", "step", "rank", "micro_batch")}
                )
    trained = {h["run_key"] for h in hits}
    links = ledger.run_links(heads)
    parent = {r.run_key: r.parent_run_key for r in links}
    downstream = sorted({(r.stage, r.run_key) for r in links if trained & set(lineage(r.run_key, parent))})
    return {
        "document": {"shard_id": shard_id, "row": row, "text": text},
        "trained_by": hits,
        "downstream_runs": [{"stage": s, "run_key": k} for s, k in downstream],
        "registered_models": registered_models(store, downstream, tracking_uri) if tracking_uri else None,
    }


def lineage(run_key: str, parent: dict[str, str | None]) -> list[str]:
    """The run and its upstream runs by the part rows' parent_run_key links (Ledger.lineage, in memory)."""
    out: list[str] = []
    cur: str | None = run_key
    while cur and cur not in out:
        out.append(cur)
        cur = parent.get(cur)
    return out


def registered_models(store: Store, runs: list[tuple[str, str]], tracking_uri: str) -> list[dict[str, Any]]:
    """The MLflow model versions registered from these runs (a version names its run's MLflow run id)."""
    from mlflow.tracking import MlflowClient

    client, out = MlflowClient(tracking_uri), []
    for stage, key in runs:
        if not completed(store, stage, key):
            continue
        run_id = run_result(store, stage, key).mlflow_run_id
        for v in client.search_model_versions(f"run_id = '{run_id}'"):
            out.append({"stage": stage, "run_key": key, "model": v.name, "version": int(v.version)})
    return out


def trace_step(store: Store, ledger: Ledger, stage: str, step: int, run_key: str | None = None) -> dict:
    """The shards, raw rows and documents each rank fed at `step` of a run of `stage`."""
    if run_key is None:
        newest = newest_completed_run(store, stage)
        if newest is None:
            raise GhostvisError(f"stage {stage} has no completed run to trace; materialize the `{stage}` asset")
        run_key = newest.run_key
    spec = saved_spec(store, stage, run_key)
    chain = ledger.chain(run_key)
    if not any(p.step_first <= step <= p.step_last for p in chain):
        raise GhostvisError(
            f"stage {stage} run {run_key} recorded no step {step} (it trained steps 1-{spec['plan']['steps']}); "
            "give a step of the run"
        )
    index = write_row_index(store, ledger, spec, chain)  # written here when the run's checks have not
    contents, snippets, fed = saved_shard_versions(spec), Snippets(store), []
    for r in ledger.row_index([index], "step = ?", [step]):
        fed.append(
            {k: getattr(r, k) for k in ("rank", "micro_batch", "global_row", "shard_id", "epoch")}
            | {
                "tokens": [r.tok_start, r.tok_end],
                "raw_rows": [r.row_start, r.row_end],
                "text": snippets.text(r.shard_id, r.row_start, contents[r.shard_id]),
            }
        )
    return {"stage": stage, "run_key": run_key, "step": step, "fed": fed}


def find_text(store: Store, ledger: Ledger, text: str, limit: int = 5) -> list[dict[str, Any]]:
    """The documents of the shards' current contents (raw_shards' record) holding the most of the text's
    fingerprints (ties kept, at most `limit`), each with `shared` and `of` (the text's fingerprints)."""
    fps = fingerprints(text)
    if not fps:
        raise GhostvisError(
            f"ghostvis trace --text: {len(normalize(text))} words have no 13-gram fingerprint; give at least 20 "
            "consecutive words of the document (two texts sharing 20 words share a fingerprint), or --doc <shard>:<row>"
        )
    found = ledger.documents_sharing(sorted(fps))
    current = {s: recorded_sha256(store, s) for s in {r.shard_id for r in found}}
    found = [r for r in found if current[r.shard_id] == r.content_sha256]
    best = found[0].shared if found else 0
    return [{**asdict(r), "of": len(fps)} for r in found if r.shared == best][:limit]

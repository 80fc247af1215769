"""`ghostvis trace` (issue 43): which stages, runs, steps and ranks trained a document, and which
documents a step fed.

Answered from the ledger (consumption, parts, feeds), the runs' launch specs and the token files, with
the audit's own row rebuild (ghostvis_core/verify/audit/rebuild.py: the row rule, the mixture, the
packing), never with the trainer's code; the raw shards only give a few characters of each document.
- a document (shard, raw row): the consumption rows that cover it name the runs and parts; each
  global row of those parts is rebuilt and kept when one of its shard spans overlaps the document's
  tokens, giving step (the row rule: step s reads rows [(s - 1) R, s R)), rank, micro-batch and epoch;
  then every run downstream of those (their lineage holds one) and, when an MLflow tracking URI is
  given, the model versions registered from them;
- a step of a run (default: the stage's newest completed run): the global rows each rank fed at that
  step (the ledger's feeds), each rebuilt to its shard spans and raw rows;
- a text: the documents of the ledger's current shards that hold the most of its 13-gram fingerprints
  (ghostvis_core/data/ngrams.py), each then traced as a document.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import pyarrow.parquet as pq

from ghostvis_core.data.catalog import raw_content
from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.ngrams import TEXT_COLUMNS, fingerprints, normalize, record_text
from ghostvis_core.errors import GhostvisError
from ghostvis_core.plan.batch import BatchPlan
from ghostvis_core.run.train.runs import newest_completed_run, run_result
from ghostvis_core.run.train.spec import shard_versions
from ghostvis_core.store import Store
from ghostvis_core.verify.audit.rebuild import PlannedRows
from ghostvis_core.verify.audit.token_files import TokenFile

SNIPPET = 60  # characters of each document shown


@dataclass
class Reader:
    """Token files and raw texts, each read once."""

    store: Store
    ledger: Ledger
    _files: dict[tuple[str, str, str], TokenFile] = field(default_factory=dict)
    _texts: dict[tuple[str, str | None], list[str]] = field(default_factory=dict)

    def token_file(self, spec: dict[str, Any], shard_id: str) -> TokenFile:
        """The token file of `shard_id` in the version the run of `spec` selected (a shard is its content)."""
        content = shard_versions(spec["train_shards"], spec["val_shards"])[shard_id]
        key = (spec["tokenizer_id"], shard_id, content)
        if key not in self._files:
            self._files[key] = TokenFile(self.store.fetch("token_shard", *key), shard_id)
        return self._files[key]

    def text(self, shard_id: str, row: int, content: str | None = None) -> str:
        """The start of raw row `row` of the shard's version with sha256 `content` (None: its current file)."""
        key = (shard_id, content)
        if key not in self._texts:
            kinds = {r["shard_id"]: r["kind"] for r in self.ledger.shards()}
            kind = kinds.get(shard_id, "text")
            raw = raw_content(self.store, shard_id, content) if content else self.store.fetch("raw_shard", shard_id)
            table = pq.read_table(raw, columns=TEXT_COLUMNS[kind])
            self._texts[key] = [record_text(kind, r) for r in table.to_pylist()]
        return self._texts[key][row][:SNIPPET].replace("\n", " ")


def shard_row(value: str) -> tuple[str, int]:
    """A document named as <shard>:<raw row>."""
    shard_id, _, row = value.rpartition(":")
    if not shard_id or not row.isdigit():
        raise GhostvisError(f"document {value!r}: give <shard>:<row>, e.g. demo_prose/00000:12 (the raw shard's row)")
    return shard_id, int(row)


def place(g: int, plan: BatchPlan) -> dict[str, int]:
    """Step, rank and micro-batch of global row g (the row rule)."""
    o = g % plan.rows_per_step
    across = plan.world_size * plan.micro_batch_size
    return {
        "step": g // plan.rows_per_step + 1,
        "rank": (o % across) // plan.micro_batch_size,
        "micro_batch": o // across,
    }


def doc_tokens(reader: Reader, spec: dict[str, Any], shard_id: str, row: int) -> tuple[int, int] | None:
    """The document's tokens [start, end) in the run's token file, or None when tokenization dropped it."""
    tf = reader.token_file(spec, shard_id)
    found = (tf.rows == row).nonzero()[0]
    return tf.doc_span(int(found[0])) if len(found) else None


def run_hits(reader: Reader, run: dict[str, Any], parts: list[dict[str, Any]], shard_id: str, row: int) -> list[dict]:
    """Every (step, rank, micro-batch, epoch) of one run whose rows read the document's tokens."""
    spec = reader.store.read_json("run_spec", run["stage"], run["run_key"])
    span = doc_tokens(reader, spec, shard_id, row)
    if span is None:
        return []
    planned, plan, hits = PlannedRows(reader.store, spec), BatchPlan.of(spec["plan"]), []
    for part in parts:
        for g in range(part["rows_first"], part["rows_last"]):
            for sp in planned.row(g).spans:
                if sp.shard_id == shard_id and sp.tok_start < span[1] and span[0] < sp.tok_end:
                    hits.append(
                        {**run, "segment": part["segment"], "epoch": sp.epoch, "global_row": g, **place(g, plan)}
                    )
                    break
    return hits


def trace_document(store: Store, ledger: Ledger, shard_id: str, row: int, tracking_uri: str | None = None) -> dict:
    """Every stage, run, segment, step, rank and epoch that trained raw row `row` of `shard_id`, the runs
    downstream of them and (with `tracking_uri`) the model versions registered from those."""
    reader = Reader(store, ledger)
    text = reader.text(shard_id, row)  # also proves the document exists
    all_parts = ledger.parts()
    covering = {
        c["part_id"]
        for c in ledger.consumption(all_parts)
        if c["shard_id"] == shard_id and c["row_start"] <= row < c["row_end"]
    }
    by_run: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for p in all_parts:
        if p["part_id"] in covering:
            by_run[(p["stage"], p["run_key"])].append(p)
    hits = [
        h
        for (stage, key), parts in sorted(by_run.items())
        for h in run_hits(reader, {"stage": stage, "run_key": key}, parts, shard_id, row)
    ]
    trained = {h["run_key"] for h in hits}
    downstream = sorted({(p["stage"], p["run_key"]) for p in all_parts if trained & set(ledger.lineage(p["run_key"]))})
    return {
        "document": {"shard_id": shard_id, "row": row, "text": text},
        "trained_by": hits,
        "downstream_runs": [{"stage": s, "run_key": k} for s, k in downstream],
        "registered_models": registered_models(store, downstream, tracking_uri) if tracking_uri else None,
    }


def registered_models(store: Store, runs: list[tuple[str, str]], tracking_uri: str) -> list[dict[str, Any]]:
    """The MLflow model versions registered from these runs (a version names its run's MLflow run id)."""
    from mlflow.tracking import MlflowClient

    client, out = MlflowClient(tracking_uri), []
    for stage, key in runs:
        if not store.exists("run_record", stage, key):
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
    spec = store.read_json("run_spec", stage, run_key)
    feeds = [f for f in ledger.feeds(ledger.chain(run_key)) if f["step"] == step]
    if not feeds:
        raise GhostvisError(
            f"stage {stage} run {run_key} recorded no step {step} (it trained steps 1-{spec['plan']['steps']}); "
            "give a step of the run"
        )
    reader, planned, fed = Reader(store, ledger), PlannedRows(store, spec), []
    versions = shard_versions(spec["train_shards"], spec["val_shards"])
    for f in feeds:
        for m, rows in enumerate(f["micro_rows"]):
            for g in rows:
                for sp in planned.row(g).spans:
                    tf = reader.token_file(spec, sp.shard_id)
                    first, last = tf.rows_of(sp.tok_start, sp.tok_end)
                    fed.append(
                        {
                            "rank": f["rank"],
                            "micro_batch": m,
                            "global_row": g,
                            "shard_id": sp.shard_id,
                            "epoch": sp.epoch,
                            "tokens": [sp.tok_start, sp.tok_end],
                            "raw_rows": [first, last],
                            "text": reader.text(sp.shard_id, first, versions[sp.shard_id]),
                        }
                    )
    return {"stage": stage, "run_key": run_key, "step": step, "fed": fed}


def find_text(ledger: Ledger, text: str, limit: int = 5) -> list[dict[str, Any]]:
    """The documents of the ledger's current shard contents holding the most of the text's fingerprints
    (ties kept, at most `limit`), each with `shared` and `of` (the text's fingerprints)."""
    fps = fingerprints(text)
    if not fps:
        raise GhostvisError(
            f"ghostvis trace --text: {len(normalize(text))} words have no 13-gram fingerprint; give at least 20 "
            "consecutive words of the document (two texts sharing 20 words share a fingerprint), or --doc <shard>:<row>"
        )
    current = {(r["shard_id"], r["content_sha256"]) for r in ledger.shards()}
    found = [r for r in ledger.documents_sharing(sorted(fps)) if (r["shard_id"], r["content_sha256"]) in current]
    best = found[0]["shared"] if found else 0
    return [{**r, "of": len(fps)} for r in found if r["shared"] == best][:limit]

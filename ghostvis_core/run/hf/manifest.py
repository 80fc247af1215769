"""The training manifest of an exported model (`ghostvis_manifest.json` beside the weights): what each
stage of its lineage trained on, read from the ledger (the part, consumption and feed rows, the shard
records of the versions the run read), never from a recipe.

Per stage, oldest first: the run key and MLflow run, steps, segments, parts, the four token figures,
the declared replay and repeat, the evaluation figures the run measured, per source the kind, domains
and every shard read (content sha256, token file sha256, the raw row span touched and the distinct raw
rows read, tokens, epochs), what tokenization dropped per reason, the sets decontamination compared
against, and `merkle`: the root of a Merkle tree
(ghostvis_core/run/hf/merkle.py) over the chain's feed rows, one leaf per (step, rank) in that order,
each leaf `part_id\\nstep\\nrank\\nstep_digest` (the content digest the rank fed, ghostvis_core/digest.py).

The manifest is deterministic: the same ledger gives the same bytes, so its sha256 (what the model card
and the MLflow model version's tags carry) can be computed without exporting.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from ghostvis_core.counts import TokenCounts
from ghostvis_core.data.catalog import load_manifest
from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.ledger.query import in_list
from ghostvis_core.data.ledger.records import ConsumptionRow, FeedRow, PartRow, ShardConsumption, ShardRecord
from ghostvis_core.errors import GhostvisError
from ghostvis_core.run.hf.merkle import leaf_hash, merkle_root
from ghostvis_core.runs.launch_spec import saved_shard_versions, saved_spec
from ghostvis_core.runs.lookup import run_result
from ghostvis_core.store import Store

MANIFEST_FILE = "ghostvis_manifest.json"
MANIFEST_FORMAT = "ghostvis-manifest/1"
LEAF_RULE = "sha256(0x00 || part_id \\n step \\n rank \\n step_digest), leaves ordered by step then rank"


def leaf_bytes(part_id: str, step: int, rank: int, step_digest: str) -> bytes:
    """One committed feed row as a Merkle leaf's bytes."""
    return f"{part_id}\n{step}\n{rank}\n{step_digest}".encode()


@dataclass(frozen=True)
class FeedLeaf:
    """What a Merkle leaf commits to of a `feeds` row: its part, step, rank and step digest (the row's
    per-micro-batch lists are not read: a long run has a row per step and rank)."""

    part_id: str
    run_key: str
    step: int
    rank: int
    step_digest: str


def feed_leaves(ledger: Ledger, chain: list[PartRow]) -> tuple[list[FeedLeaf], list[bytes]]:
    """The chain's feed rows in leaf order (step, rank) and their leaf hashes."""
    ids = sorted({p.part_id for p in chain})
    rows = ledger._query(
        FeedLeaf,
        "feeds",
        f"SELECT part_id, run_key, step, rank, step_digest FROM feeds WHERE part_id IN ({in_list(ids)}) "
        "ORDER BY step, rank",
        ids,
        ledger.run_files("feeds", [p.run_key for p in chain]),
    )
    return rows, [leaf_hash(leaf_bytes(f.part_id, f.step, f.rank, f.step_digest)) for f in rows]


def fed_row(ledger: Ledger, leaf: FeedLeaf) -> FeedRow:
    """The whole `feeds` row of a leaf: every micro-batch's global rows, row digests and image hashes."""
    return ledger._query(
        FeedRow,
        "feeds",
        "SELECT * FROM feeds WHERE part_id = ? AND step = ? AND rank = ?",
        [leaf.part_id, leaf.step, leaf.rank],
        ledger.run_files("feeds", [leaf.run_key]),
    )[0]


def manifest_bytes(manifest: dict[str, Any]) -> bytes:
    """The manifest as written: indented JSON, keys sorted, one final newline."""
    return (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()


def manifest_sha256(manifest: dict[str, Any]) -> str:
    return hashlib.sha256(manifest_bytes(manifest)).hexdigest()


def _domain(url: str) -> str:
    parsed = urlparse(url)
    return parsed.netloc or f"{parsed.scheme or 'file'}://"


def rows_read(pieces: list[ConsumptionRow]) -> dict[str, int]:
    """shard_id -> how many distinct raw rows (documents) the pieces touched, over every epoch."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for p in pieces:
        spans.setdefault(p.shard_id, []).append((p.row_start, p.row_end))
    out = {}
    for shard_id, ranges in spans.items():
        n, end = 0, 0
        for start, stop in sorted(ranges):  # only the part past the rows counted so far is new
            n += max(0, stop - max(start, end))
            end = max(end, stop)
        out[shard_id] = n
    return out


def add_dropped(total: dict[str, dict[str, int]], dropped: dict[str, dict[str, int]]) -> None:
    """Add `dropped` ({reason: {"docs", "tokens"}}, a shard's drop_reasons) into `total`."""
    for reason, n in dropped.items():
        t = total.setdefault(reason, {"docs": 0, "tokens": 0})
        t["docs"], t["tokens"] = t["docs"] + n["docs"], t["tokens"] + n["tokens"]


def shard_entry(read: ShardConsumption, record: ShardRecord | None, url: str, rows: int) -> dict[str, Any]:
    """One shard a stage read: the version's digests, where it came from and what was read of it."""
    if record is None:
        raise GhostvisError(
            f"shard {read.shard_id}: the ledger has no record of the version the run read; "
            "re-materialize tokenized_shards for it"
        )
    return {
        "shard_id": read.shard_id,
        "content_sha256": record.content_sha256,
        "token_sha256": record.token_sha256,
        "url": url,
        "split": record.split,
        "row_span": [read.row_start, read.row_end],
        "rows_read": rows,
        "tokens": read.tokens,
        "epochs": read.epochs,
    }


def sources_of(store: Store, ledger: Ledger, spec: dict[str, Any], chain: list[PartRow]) -> list[dict]:
    """Per source a stage read (sorted): kind, domains, tokens, raw rows read, the shards, and what
    tokenization dropped from those shards per reason."""
    consumed = ledger.consumed_by_shard(chain[-1].run_key)
    read = rows_read(ledger.consumption(chain))
    versions = saved_shard_versions(spec)
    records = {
        (r.shard_id, r.content_sha256): r for r in ledger.shards(tokenizer_id=spec["tokenizer_id"], every_version=True)
    }
    by_source: dict[str, list[ShardConsumption]] = {}
    for c in consumed:
        by_source.setdefault(c.source, []).append(c)
    out = []
    for source, reads in sorted(by_source.items()):
        catalog = load_manifest(store, source)
        urls = {catalog.shard_id(e): e.url for e in catalog.shards}
        recs = [records.get((c.shard_id, versions.get(c.shard_id, ""))) for c in reads]
        shards = [shard_entry(c, r, urls.get(c.shard_id, ""), read[c.shard_id]) for c, r in zip(reads, recs)]
        dropped: dict[str, dict[str, int]] = {}
        for r in recs:
            add_dropped(dropped, json.loads(r.drop_reasons or "{}"))
        out.append(
            {
                "source": source,
                "kind": catalog.kind,
                "domains": sorted({_domain(s["url"]) for s in shards if s["url"]}),
                "tokens": sum(s["tokens"] for s in shards),
                "rows_read": sum(s["rows_read"] for s in shards),
                "shards": shards,
                "dropped": dict(sorted(dropped.items())),
            }
        )
    return out


def evaluation_of(store: Store, stage: str, run_key: str) -> dict[str, Any]:
    """The held-out figures the run measured (its run record): validation loss before and after, and
    each evidence figure before and after."""
    if not store.exists("run_record", stage, run_key):
        return {}
    result = run_result(store, stage, run_key)
    return {
        "val_loss": result.val_loss,
        "val_loss_start": result.val_loss_start,
        "evidence": {name: {"before": e.before, "after": e.after} for name, e in sorted(result.evidence.items())},
    }


def stage_entry(store: Store, ledger: Ledger, chain: list[PartRow]) -> dict[str, Any]:
    """One stage of the lineage, from its run's chain of parts."""
    head = chain[-1]
    spec = saved_spec(store, head.stage, head.run_key)
    _, leaves = feed_leaves(ledger, chain)
    config = spec["config"]
    return {
        "stage": head.stage,
        "run_key": head.run_key,
        "parent_run_key": head.parent_run_key or None,
        "mlflow_run_id": head.mlflow_run_id,
        "tokenizer_id": spec["tokenizer_id"],
        "steps": head.step_last,
        "segments": sorted({p.segment for p in chain}),
        "parts": [p.part_id for p in chain],
        "tokens": TokenCounts.total(p.counts for p in chain).as_dict(),
        "replay_sources": sorted({s for p in chain for s in json.loads(p.replay_sources or "[]")}),
        "allow_repeat": any(p.allow_repeat for p in chain),
        "sources": sources_of(store, ledger, spec, chain),
        "decontamination": {
            "eval_sets": list(config["contamination"]["eval_sets"]),
            "validation_sources": list(config["data"].get("val_sources") or []),
            "max_overlap": config["contamination"]["max_overlap"],
        },
        "evaluation": evaluation_of(store, head.stage, head.run_key),
        "merkle": {"leaves": len(leaves), "root": merkle_root(leaves).hex(), "leaf": LEAF_RULE},
    }


def build_manifest(store: Store, ledger: Ledger, stage: str, run_key: str) -> dict[str, Any]:
    """The manifest of the model run `run_key` of `stage` trained: every stage of its lineage in the
    ledger, oldest first."""
    chains = [ledger.chain(k) for k in ledger.lineage(run_key)]
    chains = [c for c in chains if c]
    if not chains or chains[0][-1].run_key != run_key:
        raise GhostvisError(f"stage {stage} run {run_key} has no part in the ledger; train it before exporting it")
    stages = [stage_entry(store, ledger, c) for c in reversed(chains)]
    return {
        "format": MANIFEST_FORMAT,
        "model": {"stage": stage, "run_key": run_key},
        "tokenizer_id": stages[-1]["tokenizer_id"],
        "stages": stages,
    }

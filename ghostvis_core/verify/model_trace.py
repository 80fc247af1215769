"""`ghostvis trace --doc <shard>:<row> --model DIR`: whether a document is in a shipped model, from its
training manifest (ghostvis_core/run/hf/manifest.py) and the store, with a proof per stage that a third
party checks against the manifest alone (ghostvis_core/run/hf/inclusion.py `check_proof`).

`ghostvis trace`'s row index (ghostvis_core/verify/trace.py) gives every step and rank of a manifest stage's
run whose fed rows read the document; the first of each stage is proven: the feed row of that step and
rank, the micro-batch and global row holding the document, the leaf's index in the stage's Merkle tree
and its audit path.
"""

from __future__ import annotations

from typing import Any

from ghostvis_core.data.ledger import Ledger
from ghostvis_core.run.hf.manifest import fed_row, feed_leaves
from ghostvis_core.run.hf.merkle import audit_path
from ghostvis_core.store import Store
from ghostvis_core.verify.trace import trace_document


def stage_proof(ledger: Ledger, stage: dict[str, Any], hit: dict[str, Any]) -> dict[str, Any]:
    """The inclusion proof of one trace hit (step, rank, micro-batch, global row) in a manifest stage."""
    feeds, leaves = feed_leaves(ledger, ledger.chain(stage["run_key"]))
    index = next(i for i, f in enumerate(feeds) if (f.step, f.rank) == (hit["step"], hit["rank"]))
    feed = fed_row(ledger, feeds[index])
    return {
        "stage": stage["stage"],
        "run_key": stage["run_key"],
        "part_id": feed.part_id,
        "step": feed.step,
        "rank": feed.rank,
        "micro_batch": hit["micro_batch"],
        "global_row": hit["global_row"],
        "micro_rows": feed.micro_rows,
        "row_digests": feed.row_digests,
        "image_hashes": feed.image_hashes,
        "leaf_index": index,
        "tree_size": len(leaves),
        "path": [h.hex() for h in audit_path(leaves, index)],
    }


def document_proofs(store: Store, ledger: Ledger, manifest: dict[str, Any], shard_id: str, row: int) -> dict:
    """Per stage of the manifest: whether its run trained raw row `row` of `shard_id`, how many fed rows
    read it, and the proof of the first."""
    report = trace_document(store, ledger, shard_id, row)
    stages = []
    for stage in manifest["stages"]:
        hits = [h for h in report["trained_by"] if h["run_key"] == stage["run_key"]]
        stages.append(
            {
                "stage": stage["stage"],
                "run_key": stage["run_key"],
                "trained": bool(hits),
                "fed_rows": len(hits),
                "proof": stage_proof(ledger, stage, hits[0]) if hits else None,
            }
        )
    return {"document": report["document"], "model": manifest["model"], "stages": stages}

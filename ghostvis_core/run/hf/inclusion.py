"""Checking a document's inclusion proof (ghostvis_core/verify/model_trace.py builds it) against a shipped
model's training manifest alone: `check_proof` reads nothing but the two.

A proof names a stage's feed row (its part, step and rank, every micro-batch's global rows, row digests
and image hashes, ghostvis_core/digest.py), the micro-batch and global row holding the document, the
leaf's index in the stage's Merkle tree and its audit path. The check folds the row digests into the step
digest, hashes the leaf and walks the path: it must reach the root the manifest states for that stage,
over the number of leaves it states.
"""

from __future__ import annotations

from typing import Any

from ghostvis_core.digest import micro_digest, step_digest
from ghostvis_core.run.hf.manifest import leaf_bytes
from ghostvis_core.run.hf.merkle import leaf_hash, root_from_path


def check_proof(manifest: dict[str, Any], proof: dict[str, Any]) -> str | None:
    """Why `proof` does not hold against `manifest` (None: it holds): the document's global row is in the
    proven micro-batch, and the feed row's digests reach the stage's Merkle root."""
    stage = next(
        (s for s in manifest["stages"] if (s["stage"], s["run_key"]) == (proof["stage"], proof["run_key"])), None
    )
    if stage is None:
        return f"the manifest has no stage {proof['stage']} run {proof['run_key']}"
    if proof["part_id"] not in stage["parts"]:
        return f"part {proof['part_id']} is not one of the manifest's parts of {proof['stage']}"
    rows, digests, images = proof["micro_rows"], proof["row_digests"], proof["image_hashes"]
    mb = proof["micro_batch"]
    if not (0 <= mb < len(rows) and proof["global_row"] in rows[mb]) or len(rows) != len(digests):
        return f"global row {proof['global_row']} is not in micro-batch {mb} of the proof's feed row"
    if any(len(r) != len(d) for r, d in zip(rows, digests)):
        return "the proof's feed row has a micro-batch whose rows and row digests differ in number"
    folded = step_digest([micro_digest(d, i) for d, i in zip(digests, images)])
    leaf = leaf_hash(leaf_bytes(proof["part_id"], proof["step"], proof["rank"], folded))
    merkle = stage["merkle"]
    if proof["tree_size"] != merkle["leaves"]:
        return f"the proof's tree has {proof['tree_size']} leaves, the manifest's {merkle['leaves']}"
    root = root_from_path(leaf, proof["leaf_index"], proof["tree_size"], [bytes.fromhex(h) for h in proof["path"]])
    if root is None or root.hex() != merkle["root"]:
        return f"the proof reaches root {root.hex() if root else 'none'}, the manifest states {merkle['root']}"
    return None

"""What this rank fed the model, micro-batch by micro-batch, as content digests (ghostvis_core/digest.py):
the ledger part keeps them per rank and step, and the audit rebuilds every micro-batch from the token
files with its own reader and compares. A row recorded as consumed but never trained, or trained in
place of another, shows there even when every count and range is right."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ghostvis_core import digest
from ghostvis_core.data.loader import Batch


@dataclass
class FedLog:
    """Per step since the last checkpoint: each micro-batch's global rows, row digests, image hashes
    and digest, and the step's fold of them."""

    steps: dict[int, dict[str, list]] = field(default_factory=dict)

    def add(self, step: int, batch: Batch) -> None:
        """Digest the tensors exactly as they go to the model (the CPU batch, before any copy)."""
        inputs, targets = batch.inputs.numpy(), batch.targets.numpy()
        doc_ids = None if batch.doc_ids is None else batch.doc_ids.numpy()
        rows = [
            digest.row_digest(inputs[i], targets[i], None if doc_ids is None else doc_ids[i])
            for i in range(inputs.shape[0])
        ]
        images = [digest.image_hash(im) for im in batch.images]
        s = self.steps.setdefault(step, {"micro_rows": [], "row_digests": [], "image_hashes": [], "micro_digests": []})
        s["micro_rows"].append(list(batch.rows))
        s["row_digests"].append(rows)
        s["image_hashes"].append(images)
        s["micro_digests"].append(digest.micro_digest(rows, images))

    def records(self, rank: int) -> list[dict[str, Any]]:
        """The ledger's `feeds` rows of this rank: one per step."""
        return [
            {
                "rank": rank,
                "step": step,
                "step_digest": digest.step_digest(s["micro_digests"]),
                **{k: json.dumps(v) for k, v in s.items()},
            }
            for step, s in sorted(self.steps.items())
        ]

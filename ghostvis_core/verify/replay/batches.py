"""An interval's micro-batches as tensors, built by the audit's reader (verify/audit/rebuild.py: the token
files, the row rule, the audit's own image decoding), for the global rows the ledger's feed records say each
rank fed at each step. Nothing here reads the trainer's loader or objectives, so a trainer that feeds other
rows than it records is trained again on the recorded rows, and the weights tell."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ghostvis_core.data.bpe_tokenizer import load_tokenizer
from ghostvis_core.data.ledger.records import FeedRow
from ghostvis_core.errors import GhostvisError
from ghostvis_core.store import Store
from ghostvis_core.verify.audit.rebuild import IGNORE, PlannedRows, pixels


@dataclass
class MicroBatch:
    inputs: torch.Tensor
    targets: torch.Tensor
    doc_ids: torch.Tensor | None
    images: torch.Tensor | None  # (N, 3, size, size): the encoder's input, in the rows' order
    image_mask: torch.Tensor | None

    @property
    def units(self) -> int:
        """The loss units: target positions (lm, sft, vision_align normalise by tokens with a loss)."""
        return int((self.targets != IGNORE).sum())

    def model_inputs(self) -> dict[str, Any]:
        images = {} if self.images is None else {"images": self.images, "image_mask": self.image_mask}
        return {"doc_ids": self.doc_ids, **images}


class ReplayRows:
    """Micro-batches of recorded global rows, from the run's launch spec (a dict, as stored)."""

    def __init__(self, store: Store, spec: dict[str, Any]):
        self.rows = PlannedRows(store, spec)
        vision = spec["config"].get("vision")
        self.image_id = load_tokenizer(spec["tokenizer_id"], store).special("<|image|>") if vision else None

    def micro_batch(self, rows: list[int]) -> MicroBatch:
        built = [self.rows.row(g) for g in rows]
        inputs = torch.from_numpy(np.stack([r.inputs for r in built]).astype(np.int64))
        targets = torch.from_numpy(np.stack([r.targets for r in built]).astype(np.int64))
        docs = None if built[0].doc_ids is None else torch.from_numpy(np.stack([r.doc_ids for r in built]))
        blobs = [im for r in built for im in r.images]
        images = None
        if blobs:
            images = torch.from_numpy(np.stack([pixels(b, self.rows.image_size) for b in blobs]))
        mask = None if images is None else inputs == self.image_id
        return MicroBatch(inputs, targets, docs, images, mask)

    def step(self, feeds: dict[tuple[int, int], FeedRow], step: int, world_size: int) -> list[list[MicroBatch]]:
        """Per rank, the micro-batches of `step` (the ledger's recorded rows); a missing record is refused."""
        out = []
        for rank in range(world_size):
            feed = feeds.get((step, rank))
            if feed is None:
                raise GhostvisError(
                    f"step {step} rank {rank}: the ledger holds no feed record, so the rows to replay are unknown; "
                    "the content proof (fed_content_matches_files) names the missing part"
                )
            out.append([self.micro_batch(rows) for rows in feed.micro_rows])
        return out

"""What this rank fed the model, micro-batch by micro-batch, as content digests (ghostvis_core/digest.py):
the ledger part keeps them per rank and step, and the audit rebuilds every micro-batch from the token
files with its own reader and compares. A row recorded as consumed but never trained, or trained in
place of another, shows there even when every count and range is right.

The digest is taken from the tensors at the model's input (issue 43), not from the batch the plan
made: `watch_model_inputs` puts a forward pre-hook on the model at setup, and each micro-batch the
trainer announces (`FedLog.expect`, with its rows and images) is digested from the input ids, targets
and document ids of the first forward call after it. So a batch swapped or edited after planning, or
an objective that hands the model another tensor, no longer matches what the audit rebuilds; a
micro-batch the model never received leaves no digest, which the audit names as missing. Forward calls
with nothing announced (validation, rollout generation) are not recorded. Images are digested from
the batch's encoded bytes (what the token file holds), not from the decoded pixels.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ghostvis_core import digest
from ghostvis_core.data.loader import Batch


def _numpy(t: torch.Tensor | None):
    return None if t is None else t.detach().cpu().numpy()


@dataclass
class FedLog:
    """Per step since the last checkpoint: each micro-batch's global rows, row digests, image hashes
    and digest, and the step's fold of them."""

    steps: dict[int, dict[str, list]] = field(default_factory=dict)
    expected: tuple[int, Batch] | None = None  # the micro-batch announced and not yet at the model

    def expect(self, step: int, batch: Batch) -> None:
        """The micro-batch about to go to the model: digested when it reaches the model's input."""
        self.expected = (step, batch)

    def received(self, inputs: torch.Tensor, targets: torch.Tensor, doc_ids: torch.Tensor | None) -> None:
        """The model's input tensors of the announced micro-batch: digest and record them."""
        if self.expected is None:
            return
        (step, batch), self.expected = self.expected, None
        ids, tgt, docs = _numpy(inputs), _numpy(targets), _numpy(doc_ids)
        rows = [digest.row_digest(ids[i], tgt[i], None if docs is None else docs[i]) for i in range(ids.shape[0])]
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


def watch_model_inputs(model: torch.nn.Module, current: Callable[[], FedLog]) -> torch.utils.hooks.RemovableHandle:
    """A forward pre-hook on the model (GPT.forward(idx, targets, *, doc_ids, ...)) that hands its input
    tensors to the FedLog in use (`current()`: the trainer's part changes at every checkpoint). Put on
    the bare model, not its DDP wrapper: DDP and FSDP call it after their own input handling, so the
    hook sees what the model's first layer receives."""

    def hook(_module, args, kwargs):
        inputs = args[0] if args else kwargs.get("idx")
        targets = args[1] if len(args) > 1 else kwargs.get("targets")
        if inputs is not None and targets is not None:
            current().received(inputs, targets, kwargs.get("doc_ids"))

    return model.register_forward_pre_hook(hook, with_kwargs=True)

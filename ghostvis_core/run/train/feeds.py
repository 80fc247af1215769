"""What this rank fed the model, micro-batch by micro-batch, as content digests (ghostvis_core/digest.py):
the ledger part keeps them per rank and step, and the audit rebuilds every micro-batch from the token
files with its own reader and compares. A row recorded as consumed but never trained, or trained in
place of another, shows there even when every count and range is right.

The digest is taken from the tensors at the model's input, not from the batch the plan
made: `watch_model_inputs` puts a forward pre-hook on the model at setup, and each micro-batch the
trainer announces (`FedLog.expect`, with its rows) is digested from the input ids, targets and document
ids of the first forward call after it. Its images are digested at the image encoder's input (a
forward pre-hook there too): the pixel tensors the encoder receives during that forward call, after
decoding and resizing, which the audit rebuilds from the token file's image bytes with a decoder of its
own. So a batch swapped or edited after planning, an image decoded or replaced wrongly, or an objective
that hands the model another tensor, no longer matches what the audit rebuilds; a micro-batch the model
never received leaves no digest, which the audit names as missing. Forward calls with nothing announced
(validation, rollout generation) are not recorded.

The hooks never make the host wait for the device: they keep the tensors the model received on the
host (on the CPU those very tensors; from an accelerator a non-blocking copy into pinned memory, which
arrives while the device works), and the step digests them once, after its one host read (`settle`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ghostvis_core import digest
from ghostvis_core.data.ledger.records import FeedRow
from ghostvis_core.data.loader import Batch


def _host(t: torch.Tensor | None) -> torch.Tensor | None:
    """`t`'s values on the host without a wait: on the CPU the very tensor the model received; from an
    accelerator a non-blocking copy into pinned memory, complete once the host has read anything the device
    computed after it (the step's figures)."""
    if t is None:
        return None
    t = t.detach()
    return t if t.device.type == "cpu" else t.to("cpu", non_blocking=True)


@dataclass
class Received:
    """One recorded micro-batch as the model received it: its input ids, targets and document ids and its
    images' pixels, held on the host until `settle` digests them into the lists the FedLog keeps."""

    tensors: tuple[torch.Tensor | None, ...]
    row_digests: list[str] = field(default_factory=list)
    image_hashes: list[str] = field(default_factory=list)
    pixels: list[torch.Tensor | None] = field(default_factory=list)

    def settle(self) -> None:
        """Digest the held tensors (`ghostvis_core/digest.py`) and let them go."""
        ids, tgt, docs = (None if t is None else t.numpy() for t in self.tensors)
        self.row_digests.extend(
            digest.row_digest(ids[i], tgt[i], None if docs is None else docs[i]) for i in range(ids.shape[0])
        )
        self.image_hashes.extend(digest.image_digest(p) for px in self.pixels for p in px.numpy())
        self.tensors, self.pixels = (), []


@dataclass
class FedLog:
    """Per step since the last checkpoint: each micro-batch's global rows, row digests and image
    digests; its digest and the step's fold of them are computed when the records are made."""

    by_step: dict[int, dict[str, list]] = field(default_factory=dict)  # read through `steps`: digested
    expected: tuple[int, Batch] | None = None  # the micro-batch announced and not yet at the model
    feeding: Received | None = None  # the micro-batch inside the model's forward now
    unsettled: list[Received] = field(default_factory=list)  # received, not digested yet

    def expect(self, step: int, batch: Batch) -> None:
        """The micro-batch about to go to the model: digested when it reaches the model's input."""
        self.expected = (step, batch)

    def received(self, inputs: torch.Tensor, targets: torch.Tensor, doc_ids: torch.Tensor | None) -> None:
        """The model's input tensors of the announced micro-batch: kept on the host to be digested (`settle`);
        the images the encoder receives until this forward call ends are the micro-batch's."""
        if self.expected is None:
            return
        (step, batch), self.expected = self.expected, None
        got = Received((_host(inputs), _host(targets), _host(doc_ids)))
        s = self.by_step.setdefault(step, {"micro_rows": [], "row_digests": [], "image_hashes": []})
        s["micro_rows"].append(list(batch.rows))
        s["row_digests"].append(got.row_digests)
        s["image_hashes"].append(got.image_hashes)
        self.unsettled.append(got)
        self.feeding = got

    def images_received(self, pixels: torch.Tensor) -> None:
        """The image encoder's input (N, 3, H, W) during the forward call of a recorded micro-batch."""
        if self.feeding is not None:
            self.feeding.pixels.append(_host(pixels))

    def forward_done(self) -> None:
        self.feeding = None

    def settle(self) -> None:
        """Digest every micro-batch received since the last call from its host tensors. The trainer calls it
        after the step's one host read, when every copy from the device has arrived."""
        for got in self.unsettled:
            got.settle()
        self.unsettled.clear()

    @property
    def steps(self) -> dict[int, dict[str, list]]:
        """Per step: micro_rows, row_digests, image_hashes, every micro-batch digested (`settle`)."""
        self.settle()
        return self.by_step

    def records(self, part_id: str, run_key: str, rank: int) -> list[FeedRow]:
        """The ledger's `feeds` rows of this rank in part `part_id` of run `run_key`: one per step."""
        out = []
        for step, s in sorted(self.steps.items()):
            micro = [digest.micro_digest(r, i) for r, i in zip(s["row_digests"], s["image_hashes"])]
            out.append(FeedRow(part_id, run_key, rank, step, digest.step_digest(micro), micro, **s))
        return out


def watch_model_inputs(model: torch.nn.Module, current: Callable[[], FedLog]) -> None:
    """Hooks that hand the FedLog in use (`current()`: the trainer's part changes at every checkpoint)
    the model's input tensors (a forward pre-hook on GPT.forward(idx, targets, *, doc_ids, ...)), the
    pixels its image encoder receives (a pre-hook on `model.vision.encoder`, when the model has one) and
    the end of each forward call. Put on the bare model, not its DDP wrapper: DDP and FSDP call it after
    their own input handling, so the hooks see what the model's first layers receive."""

    def inputs(_module, args, kwargs):
        ids = args[0] if args else kwargs.get("idx")
        targets = args[1] if len(args) > 1 else kwargs.get("targets")
        if ids is not None and targets is not None:
            current().received(ids, targets, kwargs.get("doc_ids"))

    model.register_forward_pre_hook(inputs, with_kwargs=True)
    model.register_forward_hook(lambda *_: current().forward_done())
    if getattr(model, "vision", None) is not None:
        model.vision.encoder.register_forward_pre_hook(lambda _module, args: current().images_received(args[0]))

"""The training step makes the host wait for the device at most once: a CPU run of the real `train_step`
(grad accumulation 4) with every call that brings a tensor's values to the host counted while it runs.

On an accelerator each such call (`Tensor.item`, `tolist`, `cpu`, `__float__`, `__bool__`, `numpy`,
`torch.cuda.synchronize`) stops the host until the device has run everything queued before it, so the
host cannot queue the next micro-batch while the device works. On a CPU the calls cost nothing, but they
are the same calls: counting them here guards the step on every machine. Counted are calls from
GhostVis's own code (torch's optimizers read step counters the host holds, not the device's results).

The content digest reads the tensors the model received, on the host, after the step's one read
(`FedLog.settle`): those reads are counted apart, and each must be of a tensor the model received.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from ghostvis_core import digest
from ghostvis_core.home import Home
from ghostvis_core.launch.start import prepare_run

pytestmark = pytest.mark.timeout(600)

READS = ("item", "tolist", "cpu", "__float__", "__bool__", "numpy")
OWN = tuple(str(Path(__file__).resolve().parents[1] / p) for p in ("ghostvis_core", "ghostvis_pipeline"))
TENSOR_PLUMBING = str(Path(torch.__file__).parent / "_tensor.py")  # __array__ -> numpy(), __format__ -> item()
ACCUM, STEPS = 4, 3


class HostReads:
    """While `counting`: every host read made by GhostVis's own code, as (call, file:line), split into the
    step's reads and the content digest's (made inside `FedLog.settle`) with the tensors it read."""

    def __init__(self, monkeypatch):
        self.counting = False
        self.step: list[tuple[str, str]] = []
        self.digest: list[tuple[str, torch.Tensor]] = []
        for name in READS:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))
        monkeypatch.setattr(torch.cuda, "synchronize", self._wrap("torch.cuda.synchronize", torch.cuda.synchronize))

    def _wrap(self, name, original):
        def counted(*args, **kwargs):
            if self.counting:
                self._record(name, args[0] if args and isinstance(args[0], torch.Tensor) else None)
            return original(*args, **kwargs)

        return counted

    def _record(self, name: str, tensor: torch.Tensor | None) -> None:
        frame = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename == TENSOR_PLUMBING:
            frame = frame.f_back
        if frame is None or not frame.f_code.co_filename.startswith(OWN):
            return
        where = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"
        if frame.f_code.co_filename.endswith("feeds.py") and _inside(frame, "settle"):
            self.digest.append((f"{name} at {where}", tensor))
        else:
            self.step.append((name, where))


def _inside(frame, function: str) -> bool:
    while frame is not None:
        if frame.f_code.co_name == function and frame.f_code.co_filename.endswith("feeds.py"):
            return True
        frame = frame.f_back
    return False


@pytest.fixture
def trainer(home_copy):
    from ghostvis_core.run.train.dist import DistContext
    from ghostvis_core.run.train.setup import setup

    overrides = {
        "batch.world_size": 1,
        "batch.grad_accum_steps": ACCUM,
        "batch.micro_batch_size": 2,
        "batch.seq_len": 64,
        "budget.steps": STEPS,
        "eval.val_tokens": 256,
    }
    spec = prepare_run("pretrain", preset="smoke", overrides=overrides, home=Home(home_copy))
    t = setup(spec, DistContext(0, 0, 1, torch.device("cpu")))
    yield t
    t.watchdog.stop()
    t.preemption.restore()


def test_a_step_with_grad_accumulation_4_reads_the_device_once(trainer, monkeypatch):
    received: list[tuple[int, tuple]] = []  # (data_ptr, shape) of every tensor the model received

    def note(_module, args, kwargs):
        received.extend((t.data_ptr(), tuple(t.shape)) for t in args[:2])

    trainer.model.register_forward_pre_hook(note, with_kwargs=True)
    reads = HostReads(monkeypatch)
    per_step, rows_before = [], []
    for _ in range(STEPS):
        rows_before.append(trainer.state.loader.rows)
        reads.counting = True
        trainer.train_step()
        reads.counting = False
        per_step.append(Counter(reads.step))
        reads.step.clear()

    assert trainer.state.step == STEPS
    assert all(sum(c.values()) <= 1 for c in per_step), f"host reads per step (call, where): {per_step}"
    assert [sum(c.values()) for c in per_step] == [1] * STEPS  # the step's figures: one read, not none
    # the digest read each micro-batch's input ids and targets once, and nothing but what the model received
    assert len(reads.digest) == STEPS * ACCUM * 2
    assert {name.split(" ")[0] for name, _ in reads.digest} == {"numpy"}
    assert all((t.data_ptr(), tuple(t.shape)) in received for _, t in reads.digest)
    # and its digests are the format's, of the rows the plan fed
    fed = {f.step: f for f in trainer.part.fed.records("p", "r", 0)}
    for step, rows in enumerate(rows_before, start=1):
        batches = trainer.objective.step_batches(rows, trainer.plan, 0)
        want = [[digest.row_digest(b.inputs[i].numpy(), b.targets[i].numpy()) for i in range(2)] for b in batches]
        assert fed[step].row_digests == want
        assert fed[step].micro_rows == [b.rows for b in batches]


def test_the_stop_flag_is_agreed_in_the_steps_one_read(trainer, monkeypatch):
    """A signal during a step: the step finishes (all its micro-batches trained), and its one read carries the
    flag, so the checkpoint after it commits and stops the run."""
    from ghostvis_core.run.train.preemption import Preempted

    reads = HostReads(monkeypatch)
    batches_fed = []
    real_feed = trainer.part.feed

    def feed(step, batch):
        batches_fed.append(step)
        if len(batches_fed) == 2:  # the signal arrives inside step 1, before its second micro-batch
            trainer.preemption.signal_name = "SIGTERM"
        real_feed(step, batch)

    monkeypatch.setattr(trainer.part, "feed", feed)
    reads.counting = True
    trainer.train_step()
    reads.counting = False
    assert batches_fed == [1] * ACCUM and trainer.state.step == 1
    assert len(reads.step) == 1 and trainer.stop_flags == (True, False, False)
    with pytest.raises(Preempted, match=r"preempted at step 1 \(SIGTERM\)"):
        trainer.checkpoint()
    assert trainer.committed_step == 1

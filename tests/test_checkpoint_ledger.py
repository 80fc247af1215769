"""Checkpoint digests outside the checkpoint: the ledger part a checkpoint commits also records the sha256 of
the checkpoint's files, published to the store's ledger, and a resume checks the files against that copy as
well as against the COMPLETE marker. A bad copy that rewrites a checkpoint's weights and its marker together
passes the marker; the ledger's copy refuses it and the resume falls back to the checkpoint before.

The checkpoints are real: a tiny model and its optimizer saved through CheckpointManager's commit path
(checkpoint folder, marker, store, then the part into the store's ledger), on a folder store."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ghostvis_core.counts import TokenCounts
from ghostvis_core.data.ledger import Ledger
from ghostvis_core.run.model.gpt import GPT
from ghostvis_core.run.train import checkpoint as ckpt
from ghostvis_core.run.train.checkpoint_manager import CheckpointManager, write_part
from ghostvis_core.run.train.dist import DistContext
from ghostvis_core.store.folder import FolderStore
from ghostvis_core.store.layout import step_dir_name
from tests.ledger_rows import part
from tests.test_bad_inputs import TINY, flip_byte


def manager(root: Path) -> CheckpointManager:
    spec = SimpleNamespace(stage="pretrain", run_key="r1", config=SimpleNamespace(to_dict=lambda: {"model": "tiny"}))
    ctx = DistContext(0, 0, 1, torch.device("cpu"))
    return CheckpointManager(FolderStore(root), spec, ctx, keep_last=3, async_save=False, sharded=False)


@pytest.fixture
def store(tmp_path) -> Path:
    """Checkpoints of steps 1 and 2 of run r1, each committed with its ledger part (one rank, no pieces)."""
    root = tmp_path / "store"
    checkpoints = manager(root)
    torch.manual_seed(0)
    model = GPT(TINY)
    opt = torch.optim.AdamW(model.parameters())
    for step in (1, 2):
        model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)).backward()
        opt.step()
        staging = checkpoints.run_dir / f".ledger-p{step}"
        record = part(f"p{step}", "r1", steps=(step, step), prev=f"p{step - 1}" if step > 1 else "", segment=0)
        write_part(staging, record, [([], TokenCounts(), [], [])], [], lambda p: (0, 0), 1)
        checkpoints._save_and_publish(step, {"step": step}, {"ledger": staging}, model, opt)
    return root


def step_dir(root: Path, step: int) -> Path:
    return root / "checkpoints" / "pretrain" / "r1" / step_dir_name(step)


def test_the_store_ledger_holds_each_checkpoint_files_digests_as_its_marker_does(store):
    ledger = Ledger.in_store(FolderStore(store))
    for step in (1, 2):
        marker = ckpt.read_json(step_dir(store, step), ckpt.MARKER)["sha256"]
        recorded = ledger.checkpoint_files("r1", step)
        assert sorted(recorded) == ["config.json", "model.safetensors", "optimizer.safetensors", "train_state.json"]
        assert recorded == {f: d for f, d in marker.items() if f in recorded}
    weights = [ledger.checkpoint_files("r1", step)["model.safetensors"] for step in (1, 2)]
    assert weights[0] != weights[1]


def test_weights_rewritten_with_their_marker_pass_the_marker_but_the_ledger_refuses_them(store, capsys):
    folder = step_dir(store, 2)
    flip_byte(folder / "model.safetensors")
    ckpt.write_marker(folder, 2)  # the bad copy's marker hashes the bad weights
    ckpt.verify(folder)  # the marker alone is satisfied
    resumed = manager(store)
    assert resumed.newest().step == 1
    [passed] = resumed.passed_over
    assert (passed["checkpoint"], passed["step"]) == ("step_000000002", 2)
    assert passed["reason"].startswith("model.safetensors has sha256 ")
    recorded = Ledger.in_store(FolderStore(store)).checkpoint_files("r1", 2)["model.safetensors"]
    assert passed["reason"].endswith(f"..., the ledger recorded {recorded[:12]}...")
    said = capsys.readouterr().out
    assert f"checkpoint {folder}: model.safetensors has sha256 " in said
    assert "its files and its COMPLETE marker were rewritten together since it was committed" in said


def test_an_intact_checkpoint_resumes_and_one_whose_part_is_not_published_yet_goes_by_its_marker(store):
    assert manager(store).newest().step == 2
    for f in (store / "ledger" / "checkpoint_files").rglob("*.parquet"):
        f.unlink()  # a crash between the marker and the part's copy into the store's ledger
    resumed = manager(store)
    assert resumed.newest().step == 2 and resumed.passed_over == []

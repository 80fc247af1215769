"""Checkpoints: exact round trip of weights and AdamW state, atomic commit, pruning, shape checks,
pickle-free files."""

from __future__ import annotations

import dataclasses
import json
import re
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ghostvis_core.errors import GhostvisError
from ghostvis_core.plan.config import ModelConfig
from ghostvis_core.run.model.gpt import GPT
from ghostvis_core.run.train import checkpoint as ckpt

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=16)


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW with decay / no-decay groups, like the training loop's."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-2, betas=(0.9, 0.95)
    )


def train_step(model, opt, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, CFG.vocab_size, (2, 9), generator=g)
    opt.zero_grad()
    model(x[:, :-1], x[:, 1:]).backward()
    opt.step()


def trained(seed=0, cfg=CFG):
    torch.manual_seed(seed)
    model = GPT(cfg)
    opt = make_optimizer(model)
    train_step(model, opt, 123)
    return model, opt


def save(run_dir: Path, step: int, model, opt, **state) -> Path:
    return ckpt.save(
        run_dir,
        step,
        model=model,
        optimizer=opt,
        state={"step": step, **state},
        config={"model": dataclasses.asdict(CFG)},
    )


def saved_steps(tmp_path: Path, *steps: int) -> tuple[Path, GPT, torch.optim.Optimizer]:
    """A trained model committed at `steps`, in this order, into the run folder tmp_path/run: (run, model, opt)."""
    run = tmp_path / "run"
    model, opt = trained()
    for step in steps:
        save(run, step, model, opt)
    return run, model, opt


# ---------------------------------------------------------------- round trip


def test_round_trip_restores_identical_weights_and_optimizer_state(tmp_path):
    model, opt = trained(seed=0)
    path = save(tmp_path / "run", 1, model, opt, rows_consumed=32)
    assert path == tmp_path / "run" / "step_000000001"

    model2, _ = trained(seed=99)  # different weights to start from
    opt2 = make_optimizer(model2)
    ckpt.load_model(path, model2)
    ckpt.load_optimizer(path, model2, opt2)

    sd1, sd2 = model.state_dict(), model2.state_dict()
    assert sd1.keys() == sd2.keys()
    for k in sd1:
        assert torch.equal(sd1[k], sd2[k]), k
    names2 = dict(model2.named_parameters())
    n_state = 0
    for name, p in model.named_parameters():
        st1, st2 = opt.state[p], opt2.state[names2[name]]
        assert set(st1) == set(st2) == {"step", "exp_avg", "exp_avg_sq"}, name
        for key in st1:
            assert torch.equal(st1[key], st2[key]), (name, key)
            assert st1[key].dtype == st2[key].dtype
        n_state += 1
    assert n_state == len(list(model.parameters()))
    assert float(opt2.state[names2["embed.weight"]]["step"]) == 1.0

    # the restored pair continues exactly as the original would
    train_step(model, opt, 7)
    train_step(model2, opt2, 7)
    for (k, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), k

    assert ckpt.read_state(path) == {"step": 1, "rows_consumed": 32}
    assert ckpt.read_json(path, "config.json") == {"model": dataclasses.asdict(CFG)}


def test_round_trip_with_tied_embeddings(tmp_path):
    cfg = dataclasses.replace(CFG, tie_embeddings=True)
    model, opt = trained(seed=0, cfg=cfg)
    path = ckpt.save(tmp_path / "run", 1, model=model, optimizer=opt, state={}, config={})
    torch.manual_seed(5)
    model2 = GPT(cfg)
    ckpt.load_model(path, model2)
    assert model2.lm_head.weight is model2.embed.weight  # still tied after loading
    assert torch.equal(model2.embed.weight, model.embed.weight)


# ---------------------------------------------------------------- atomic commit


def test_leftover_tmp_dir_is_ignored_and_removed_by_the_next_prune(tmp_path):
    run, model, opt = saved_steps(tmp_path, 1)
    # a crash while writing step 2: a temp dir with (even) a marker in it, never renamed
    crashed = run / ".tmp-step_000000002-deadbeef"
    crashed.mkdir()
    (crashed / "model.safetensors").write_bytes(b"half a file")
    (crashed / ckpt.MARKER).write_text("2")
    assert [c.step for c in ckpt.list_complete(run)] == [1]
    assert ckpt.latest_complete(run).step == 1
    save(run, 3, model, opt)
    assert ckpt.prune(run, 2) == [] and not crashed.exists()
    assert [c.step for c in ckpt.list_complete(run)] == [1, 3]
    assert sorted(p.name for p in run.iterdir()) == ["step_000000001", "step_000000003"]


def test_crash_during_save_leaves_no_committed_checkpoint(tmp_path, monkeypatch):
    run, model, opt = saved_steps(tmp_path, 1)

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "optimizer_tensors", boom)
    with pytest.raises(
        GhostvisError,
        match=r"checkpoint step 2 could not be written to \S+ \(disk full\): it needs about [\d,]+ bytes and "
        r"[\d,]+ are free there; the previous checkpoint step_000000001 is intact and stays the newest",
    ):
        save(run, 2, model, opt)
    monkeypatch.undo()
    assert [c.step for c in ckpt.list_complete(run)] == [1]
    assert not (run / "step_000000002").exists()
    assert not [p.name for p in run.iterdir() if p.name.startswith(".tmp-")]  # the partial folder is removed
    ckpt.load_model(run / "step_000000001", trained()[0])  # and the previous one still loads
    # a crash that kills the process mid-write (no cleanup) leaves a .tmp folder: ignored, then pruned
    (run / ".tmp-step_000000002-dead").mkdir()
    assert [c.step for c in ckpt.list_complete(run)] == [1]
    save(run, 2, model, opt)  # the retry commits, the manager's prune cleans up
    assert ckpt.prune(run, 2) == [] and [c.step for c in ckpt.list_complete(run)] == [1, 2]
    assert not any(p.name.startswith(".tmp-") for p in run.iterdir())


FULL_DISK = """
import sys
from tests.test_checkpoint import ckpt, save, trained
model, opt = trained()
run = ckpt.Path(sys.argv[1])
save(run, 1, model, opt)
try:
    save(run, 2, model, opt)
except ckpt.GhostvisError as exc:
    print(exc)
print([c.step for c in ckpt.list_complete(run)], sorted(p.name for p in run.iterdir()))
"""


def test_a_real_full_disk_names_the_bytes_needed_and_free_and_keeps_the_previous_checkpoint(tmp_path):
    """A tmpfs with room for one checkpoint and a half, in a mount namespace of the test's own (root, as CI)."""
    import shutil as sh
    import subprocess
    import sys

    model, opt = trained()
    one = sum(f.stat().st_size for f in save(tmp_path / "probe", 1, model, opt).iterdir())
    disk = tmp_path / "disk"
    disk.mkdir()
    script = f"mount -t tmpfs -o size={one * 3 // 2} tmpfs {disk} && {sys.executable} -c '{FULL_DISK}' {disk}/run"
    proc = subprocess.run(
        [sh.which("unshare"), "--mount", "--propagation", "private", "sh", "-c", script],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    error, listing = proc.stdout.strip().splitlines()
    needed, free = (int(n.replace(",", "")) for n in re.findall(r"([\d,]+) (?:bytes|are free)", error))
    assert error.startswith(f"checkpoint step 2 could not be written to {disk}/run/.tmp-step_000000002-")
    assert "(No space left on device)" in error and needed >= one * 9 // 10 and free < needed
    assert listing == "[1] ['step_000000001']"  # the partial step 2 is gone; step 1 stays the newest


def test_step_dir_without_marker_is_ignored(tmp_path):
    run, model, opt = saved_steps(tmp_path, 1)
    partial = run / "step_000000009"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"")
    (run / "step_12").mkdir()  # wrong name pattern: not a checkpoint either
    (run / "step_12" / ckpt.MARKER).write_text("12")
    assert [c.step for c in ckpt.list_complete(run)] == [1]
    assert ckpt.latest_complete(run).path == run / "step_000000001"
    # saving that very step replaces the unfinished folder with a committed one
    save(run, 9, model, opt)
    assert ckpt.read_json(run / "step_000000009", ckpt.MARKER)["step"] == 9
    assert [c.step for c in ckpt.list_complete(run)] == [1, 9]


def test_missing_or_empty_run_dir(tmp_path):
    assert ckpt.list_complete(tmp_path / "nope") == [] and ckpt.latest_complete(tmp_path / "nope") is None
    (tmp_path / "empty").mkdir()
    assert ckpt.latest_complete(tmp_path / "empty") is None


def test_missing_file_is_a_named_error(tmp_path):
    model, opt = trained()
    path = save(tmp_path / "run", 1, model, opt)
    (path / "optimizer.safetensors").unlink()
    with pytest.raises(GhostvisError, match="optimizer.safetensors is missing"):
        ckpt.load_optimizer(path, model, make_optimizer(model))


# ---------------------------------------------------------------- prune


def test_prune_keeps_the_newest_two(tmp_path):
    run = saved_steps(tmp_path, 10, 20, 30, 40, 50)[0]
    assert [c.step for c in ckpt.list_complete(run)] == [10, 20, 30, 40, 50]
    ckpt.prune(run, 2)
    assert [c.step for c in ckpt.list_complete(run)] == [40, 50]
    assert sorted(p.name for p in run.iterdir()) == ["step_000000040", "step_000000050"]


def test_pruning_after_each_save_keeps_the_newest_and_names_what_it_removed(tmp_path):
    run = tmp_path / "run"
    model, opt = trained()
    removed = []
    for step in (1, 2, 3, 4):
        save(run, step, model, opt)
        removed += ckpt.prune(run, 2)
        steps = [c.step for c in ckpt.list_complete(run)]
        assert steps[-1] == step and len(steps) == min(step, 2)
    assert removed == ["step_000000001", "step_000000002"]
    for keep in (0, -3):
        ckpt.prune(run, keep)
        assert [c.step for c in ckpt.list_complete(run)] == [4]


def test_prune_orders_by_step_number_not_by_name_or_mtime(tmp_path):
    run = saved_steps(tmp_path, 100, 9, 1000)[0]  # written out of order
    ckpt.prune(run, 2)
    assert [c.step for c in ckpt.list_complete(run)] == [100, 1000]


# ---------------------------------------------------------------- shape checks


def test_loading_into_a_model_with_other_layers_names_the_keys(tmp_path):
    model, opt = trained()
    path = save(tmp_path / "run", 1, model, opt)
    deeper = GPT(dataclasses.replace(CFG, n_layers=3))
    with pytest.raises(GhostvisError) as exc:
        ckpt.load_model(path, deeper)
    assert "blocks.2." in str(exc.value) and "missing" in str(exc.value)
    shallower = GPT(dataclasses.replace(CFG, n_layers=1))
    with pytest.raises(GhostvisError) as exc:
        ckpt.load_model(path, shallower)
    assert "blocks.1." in str(exc.value) and "unexpected" in str(exc.value)


@pytest.mark.parametrize(
    "change, name",
    [
        (dict(ffn_hidden=40), "ffn.w13.weight"),
        (dict(d_model=64), "attn.wq.weight"),
        (dict(vocab_size=80), "embed.weight"),
    ],
)
def test_loading_into_a_model_of_another_width_is_a_ghostvis_error(tmp_path, change, name):
    model, opt = trained()
    path = save(tmp_path / "run", 1, model, opt)
    other = GPT(dataclasses.replace(CFG, **change))
    with pytest.raises(GhostvisError) as exc:
        ckpt.load_model(path, other)
    assert name in str(exc.value) and "tensor shapes do not fit" in str(exc.value)


# ---------------------------------------------------------------- no pickle


def test_files_are_safetensors_not_pickle(tmp_path):
    model, opt = trained()
    path = save(tmp_path / "run", 1, model, opt)
    assert sorted(p.name for p in path.iterdir()) == [
        "COMPLETE",
        "config.json",
        "model.safetensors",
        "optimizer.safetensors",
        "train_state.json",
    ]
    for name in ("model.safetensors", "optimizer.safetensors"):
        raw = (path / name).read_bytes()
        (header_len,) = struct.unpack("<Q", raw[:8])  # safetensors: u64 header size, then JSON
        header = json.loads(raw[8 : 8 + header_len])
        assert isinstance(header, dict)
        assert not raw.startswith(b"\x80") and b"PK\x03\x04" not in raw[:8]  # not a pickle / torch zip
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert keys == set(model.state_dict())
        assert torch.equal(f.get_tensor("blocks.0.ffn.w13.weight"), model.blocks[0].ffn.w13.weight.detach())
    with safe_open(str(path / "optimizer.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        names = [n for n, _ in model.named_parameters()]
        assert keys == {f"{n}::{k}" for n in names for k in ("step", "exp_avg", "exp_avg_sq")}
        p = dict(model.named_parameters())["lm_head.weight"]
        assert torch.equal(f.get_tensor("lm_head.weight::exp_avg"), opt.state[p]["exp_avg"])

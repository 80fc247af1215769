"""Muon (ghostvis_core/run/train/muon.py): the Newton-Schulz orthogonalization against an SVD, which
parameters of the real GPT get Muon and which AdamW, the AdamW half against torch.optim.AdamW, and on
2 gloo ranks: DDP and FSDP2 train to the same losses, and both resume exactly from their checkpoints
(safetensors for DDP, DCP shards for FSDP2). The 2-rank helpers are tests/gloo_ranks.py's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ghostvis_core.plan.config import ModelConfig, OptimConfig
from ghostvis_core.run.model.gpt import GPT
from ghostvis_core.run.train import checkpoint as ckpt
from ghostvis_core.run.train.dist import DistContext
from ghostvis_core.run.train.muon import Muon, make_muon, orthogonalized, zeropower_via_newtonschulz5
from ghostvis_core.run.train.parallel import wrap
from tests.conftest import run_cli, torchrun_stage
from tests.gloo_ranks import CFG, resumed, spawn, train_steps, write_then_continue

OPTIM = OptimConfig(name="muon", lr=1e-2, muon_lr=0.02)


@pytest.mark.parametrize("shape", [(48, 32), (32, 48), (96, 32)])
def test_newton_schulz_gives_the_svd_polar_factor_with_singular_values_near_1(shape):
    m = torch.randn(*shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    u, s_in, vh = torch.linalg.svd(m, full_matrices=False)
    out = zeropower_via_newtonschulz5(m.float()).double()
    u_out, s_out, vh_out = torch.linalg.svd(out, full_matrices=False)
    assert float(s_in.max() / s_in.min()) > 3  # the input's singular values are spread
    # the reference coefficients trade exact convergence for speed: they land in [0.68, 1.2], not on 1
    assert 0.65 < float(s_out.min()) and float(s_out.max()) < 1.21
    # an odd polynomial of the matrix: the singular vectors are the input's, so U' V'^T is the SVD's U V^T
    assert torch.allclose(u_out @ vh_out, u @ vh, atol=1e-5)


def _names(model: torch.nn.Module, params: list) -> set[str]:
    ids = {id(p) for p in params}
    return {n for n, p in model.named_parameters() if id(p) in ids}


@pytest.mark.parametrize("tied", [False, True])
def test_muon_takes_the_hidden_matrices_of_the_gpt_and_adamw_the_rest(tied):
    cfg = ModelConfig(**{**CFG.__dict__, "qkv_bias": True, "tie_embeddings": tied})
    model = GPT(cfg)
    opt = make_muon(model, OPTIM)
    adam_matrices, adam_vectors, muon = opt.param_groups
    hidden = {
        f"blocks.{i}.{w}.weight"
        for i in range(cfg.n_layers)
        for w in ("attn.wq", "attn.wkv", "attn.wo", "ffn.w13", "ffn.w2")
    }
    assert _names(model, muon["params"]) == hidden
    assert _names(model, adam_matrices["params"]) == ({"embed.weight"} if tied else {"embed.weight", "lm_head.weight"})
    vectors = _names(model, adam_vectors["params"])
    assert vectors == {n for n, p in model.named_parameters() if p.dim() == 1}
    assert len(vectors) == cfg.n_layers * 4 + 1  # per block 2 norms and the wq, wkv biases; the final norm
    # the trainer's schedule multiplies lr_scale: muon_lr moves by the same factor as lr
    assert (muon["use_muon"], muon["lr"], muon["lr_scale"]) == (True, 0.02, pytest.approx(2.0))
    assert (adam_matrices["use_muon"], adam_matrices["lr_scale"], adam_matrices["weight_decay"]) == (False, 1.0, 0.1)
    assert adam_vectors["weight_decay"] == 0.0 and muon["weight_decay"] == 0.1


def _decay_groups(model: torch.nn.Module) -> list[dict]:
    return [
        {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]


def test_the_adamw_groups_step_like_torch_adamw():
    torch.manual_seed(0)
    mine, ref = GPT(CFG), GPT(CFG)
    ref.load_state_dict(mine.state_dict())
    start = {n: p.detach().clone() for n, p in mine.named_parameters()}
    opts = [
        Muon(_decay_groups(mine), lr=1e-2, momentum=0.95, betas=(0.9, 0.95)),
        torch.optim.AdamW(_decay_groups(ref), lr=1e-2, betas=(0.9, 0.95)),
    ]
    x = torch.randint(0, CFG.vocab_size, (4, 9), generator=torch.Generator().manual_seed(1))
    for _ in range(5):
        for model, opt in zip((mine, ref), opts):
            model(x[:, :-1], x[:, 1:]).backward()
            opt.step()
            opt.zero_grad()
    for (name, a), (_, b) in zip(mine.named_parameters(), ref.named_parameters()):
        assert not torch.equal(a, start[name]), name  # it moved
        # the same arithmetic in another op order: a few ulps apart after 5 steps (1.6e-7 at most on an AVX2-only
        # CPU, where a grad near 0 meets Adam's normalization); a wrong update would be off by ~1e-3 (lr 1e-2)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)


def _fresh(strategy: str, rank: int, world: int):
    torch.manual_seed(0)
    par = wrap(GPT(CFG), DistContext(rank, rank, world, torch.device("cpu")), strategy)
    return par, make_muon(par.model, OPTIM)


def _losses(rank, world, strategy):
    par, opt = _fresh(strategy, rank, world)
    return train_steps(par, opt, range(10), rank, world)


def test_muon_under_ddp_and_fsdp2_gives_the_same_losses_for_10_steps():
    ddp = spawn(_losses, "ddp")
    fsdp = spawn(_losses, "fsdp")
    assert ddp[0] == ddp[1] and fsdp[0] == fsdp[1]  # every rank reports the same reduced loss
    assert ddp[0][-1] < ddp[0][0] - 1.0  # it learns the two batches
    # fp32 on both sides; only the gradient reduction order differs (all-reduce vs reduce-scatter)
    assert fsdp[0] == pytest.approx(ddp[0], rel=1e-6)  # measured: 9e-8 at most


def _uneven_rows(rank, world):
    """A 7 x 5 matrix sharded by rows over 2 ranks (4 + 3): each rank gets its rows of the full result."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.randn(7, 5, generator=torch.Generator().manual_seed(3))
    sharded = distribute_tensor(full, init_device_mesh("cpu", (world,)), [Shard(0)])
    out = orthogonalized(sharded)
    return out.placements == sharded.placements, out.to_local().tolist(), zeropower_via_newtonschulz5(full).tolist()


def test_a_row_sharded_matrix_is_orthogonalized_whole_and_each_rank_keeps_its_rows():
    (same0, rows0, ref), (same1, rows1, _) = spawn(_uneven_rows)
    assert same0 and same1 and (len(rows0), len(rows1)) == (4, 3)
    assert rows0 + rows1 == ref


def _write_then_continue(rank, world, run_dir, strategy):
    """3 steps, a checkpoint the way commit.py writes it for the strategy, 3 more steps."""
    par, opt = _fresh(strategy, rank, world)
    return write_then_continue(par, opt, rank, world, run_dir, shards=strategy == "fsdp")


def _resume(rank, world, path, strategy):
    par, opt = resumed(path, rank, world, strategy, lambda model: make_muon(model, OPTIM))
    from torch.distributed.tensor import DTensor

    buffers = [st["momentum_buffer"] for st in opt.state.values() if "momentum_buffer" in st]
    momentum = (len(buffers), sum(isinstance(b, DTensor) for b in buffers))  # under FSDP2 sharded like the weights
    return momentum, train_steps(par, opt, range(ckpt.read_state(Path(path))["step"], 6), rank, world)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_muon_resumes_exactly_from_its_checkpoint(tmp_path, strategy):
    uninterrupted = spawn(_write_then_continue, str(tmp_path), strategy)[0]
    ref = ckpt.latest_complete(tmp_path)
    assert ref.step == 3 and (ref.path / ckpt.DCP_DIR).is_dir() == (strategy == "fsdp")
    (momentum, again), _ = spawn(_resume, str(ref.path), strategy)
    hidden = CFG.n_layers * 5
    assert momentum == (hidden, hidden if strategy == "fsdp" else 0)  # every hidden matrix's momentum came back
    assert again == uninterrupted  # bit for bit: weights, momentum, AdamW moments and steps restored


@pytest.mark.e2e
def test_the_trainer_runs_muon_under_fsdp_through_torchrun(home_copy):
    """The real CLI: 8 pretraining steps of the smoke preset with Muon on 2 FSDP2 ranks, a DCP
    checkpoint at step 4 and at the end, one MLflow run with the optimizer in its params."""
    from mlflow.tracking import MlflowClient

    from ghostvis_core.home import Home
    from ghostvis_core.runs.lookup import run_result

    sets = ["optim.name=muon", "budget.steps=8", "parallel.strategy=fsdp", "checkpoint.every_steps=4"]
    run_cli(
        torchrun_stage(home_copy, "pretrain", *sets),
        home_copy,
    )
    client = MlflowClient(Home(home_copy).mlflow_tracking_uri)
    runs = client.search_runs([client.get_experiment_by_name("ghostvis").experiment_id], "params.`optim.name` = 'muon'")
    assert len(runs) == 1 and runs[0].data.params["parallel.strategy"] == "fsdp"
    assert runs[0].data.params["attention_kernel"] == "sdpa-per-document"  # the CPU's kernel (gpt.attention_kernel)
    losses = [m.value for m in client.get_metric_history(runs[0].info.run_id, "train/loss")]
    assert len(losses) >= 3 and losses[-1] < losses[0] - 0.3  # it learns (measured 8.35 -> 7.74 under DDP)
    run_dir = Home(home_copy).store.fetch("checkpoints", "pretrain", runs[0].info.run_name)
    record = run_result(Home(home_copy).store, "pretrain", runs[0].info.run_name)
    assert record.attention_kernel == "sdpa-per-document"  # the run record (and the report card) say it too
    assert [r.step for r in ckpt.list_complete(run_dir)] == [4, 8]
    assert all((r.path / ckpt.DCP_DIR).is_dir() for r in ckpt.list_complete(run_dir))

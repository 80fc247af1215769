"""FSDP2 on 2 gloo ranks (CPU): same losses as DDP, sharded (DCP) checkpoints that resume on another
world size, frozen modules untouched, evaluation with uneven work per rank.

Each test spawns 2 processes (torch.multiprocessing) running the real `parallel.wrap` and
`checkpoint` code on a tiny GPT; results come back through a queue.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from ghostvis_core.errors import GhostvisError
from ghostvis_core.plan.config import ModelConfig
from ghostvis_core.run.model.gpt import GPT
from ghostvis_core.run.model.vision import frozen_fingerprint
from ghostvis_core.run.train import checkpoint as ckpt
from ghostvis_core.run.train.dist import DistContext
from ghostvis_core.run.train.parallel import Sharded, SingleProcess, wrap
from tests.gloo_ranks import CFG, ROWS_PER_STEP, commit, resumed, spawn, train_steps, write_then_continue

# fp32 on both sides; the only difference is the order of the gradient reductions (all-reduce vs
# reduce-scatter), so losses agree to float rounding, compounded over 20 AdamW steps.
LOSS_RTOL = 1e-4


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, betas=(0.9, 0.95))


def _fresh(strategy: str, rank: int, world: int, freeze: bool = False):
    torch.manual_seed(0)
    model = GPT(CFG)
    if freeze:
        model.blocks[0].requires_grad_(False)
    par = wrap(model, DistContext(rank, rank, world, torch.device("cpu")), strategy)
    return par, _optimizer(par.model)


def _losses(rank, world, strategy):
    par, opt = _fresh(strategy, rank, world)
    assert isinstance(par, Sharded) == (strategy == "fsdp")
    return train_steps(par, opt, range(20), rank, world)


def test_fsdp_and_ddp_give_the_same_losses_for_20_steps():
    ddp = spawn(_losses, "ddp")
    fsdp = spawn(_losses, "fsdp")
    assert ddp[0] == ddp[1] and fsdp[0] == fsdp[1]  # every rank reports the same reduced loss
    assert ddp[0][-1] < ddp[0][0] - 0.5  # it learns
    assert fsdp[0] == pytest.approx(ddp[0], rel=LOSS_RTOL)


def _write_then_continue(rank, world, run_dir, strategy="fsdp"):
    par, opt = _fresh(strategy, rank, world)
    return write_then_continue(par, opt, rank, world, run_dir, shards=True)


def _resume(rank, world, path):
    par, opt = resumed(path, rank, world, "fsdp", _optimizer)
    state = ckpt.read_state(Path(path))
    return state, train_steps(par, opt, range(state["step"], 6), rank, world)


def _resume_single(path):
    """World size 1: no process group at all, the full model in one process."""
    model = GPT(CFG)
    ckpt.load_model(Path(path), model)
    par = SingleProcess(model)
    opt = _optimizer(model)
    ckpt.load_optimizer(Path(path), model, opt)
    state = ckpt.read_state(Path(path))
    return state, train_steps(par, opt, range(state["step"], 6), 0, 1)


def test_a_dcp_checkpoint_from_2_ranks_resumes_exactly_on_2_and_on_1(tmp_path):
    uninterrupted = spawn(_write_then_continue, str(tmp_path))[0]
    ref = ckpt.latest_complete(tmp_path)
    assert ref.step == 3 and (ref.path / ckpt.DCP_DIR).is_dir()
    assert sorted(f.name for f in (ref.path / ckpt.DCP_DIR).glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert not (ref.path / "model.safetensors").exists()
    assert not list(tmp_path.glob(".dcp-*"))  # the staging folder became the checkpoint's dcp/
    (state2, on_two), _ = spawn(_resume, str(ref.path))
    state1, on_one = _resume_single(str(ref.path))
    assert state1 == state2 == {"step": 3, "rows": 3 * ROWS_PER_STEP}  # data position, world-size free
    assert on_two == pytest.approx(uninterrupted, rel=1e-6)
    assert on_one == pytest.approx(uninterrupted, rel=LOSS_RTOL)


def _slow_writes(seconds: float) -> None:
    """This rank's DCP file writes start `seconds` late (the real writer, only delayed)."""
    import time

    from torch.distributed.checkpoint import FileSystemWriter

    write = FileSystemWriter.write_data
    FileSystemWriter.write_data = lambda self, plan, planner: (time.sleep(seconds), write(self, plan, planner))[1]


def _write_async_then_continue(rank, world, run_dir, strategy):
    """start_shards at step 3, train steps 4-6 while the shards are written (rank 1 writes 1.5 s late),
    then commit: rank 0 writes the marker only after `wait`."""
    par, opt = _fresh(strategy, rank, world)
    train_steps(par, opt, range(3), rank, world)
    if rank == 1:
        _slow_writes(1.5)
    in_flight = ckpt.start_shards(Path(run_dir), 3, par.model, opt)
    losses = train_steps(par, opt, range(3, 6), rank, world)  # the weights change under the save
    not_done_during_training = not in_flight.future.done()
    extra = in_flight.wait()
    written = []
    if rank == 0:
        written = sorted(f.name for f in extra[ckpt.DCP_DIR].iterdir())  # on disk when rank 0's wait returns
        assert ckpt.latest_complete(Path(run_dir)) is None  # no marker before the shards were waited for
        commit(Path(run_dir), par, opt, extra)
    dist.barrier()
    return losses, written, not_done_during_training


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_an_async_dcp_checkpoint_resumes_exactly_like_a_sync_one(tmp_path, strategy):
    sync_dir, async_dir = tmp_path / "sync", tmp_path / "async"
    uninterrupted = spawn(_write_then_continue, str(sync_dir), strategy)[0]
    (losses, written, slow), (_, _, slow1) = spawn(_write_async_then_continue, str(async_dir), strategy)
    assert losses == pytest.approx(uninterrupted, rel=1e-6)  # training went on while the shards were written
    assert slow and slow1  # rank 1's late write kept the save in flight through three training steps
    # rank 0's wait returned only once every rank's shard and DCP's metadata were on disk
    assert written == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    ref = ckpt.latest_complete(async_dir)
    assert ref.step == 3 and (ref.path / ckpt.MARKER).exists() and not list(async_dir.glob(".dcp-*"))
    sync_model, async_model = GPT(CFG), GPT(CFG)
    ckpt.load_model(ckpt.latest_complete(sync_dir).path, sync_model)
    ckpt.load_model(ref.path, async_model)
    for (name, a), (_, b) in zip(sync_model.state_dict().items(), async_model.state_dict().items()):
        assert torch.equal(a, b), name  # the step-3 weights, not the ones trained while writing
    (state, on_two), _ = spawn(_resume, str(ref.path))
    assert state == {"step": 3, "rows": 3 * ROWS_PER_STEP}
    assert on_two == pytest.approx(uninterrupted, rel=1e-6)


def test_a_dcp_checkpoint_exports_to_one_safetensors_file_equal_to_the_weights(tmp_path):
    spawn(_write_then_continue, str(tmp_path))
    path = ckpt.latest_complete(tmp_path).path
    full = GPT(CFG)
    ckpt.load_model(path, full)
    out = ckpt.export_safetensors(path, tmp_path / "export" / "model.safetensors")
    exported = load_file(str(out))
    for name, a in full.state_dict().items():
        assert torch.equal(a, exported[name]), name


def _frozen(rank, world):
    par, opt = _fresh("fsdp", rank, world, freeze=True)
    before = frozen_fingerprint(par.model)
    trained_before = par.model.blocks[1].ffn.w2.weight.full_tensor().clone()
    train_steps(par, opt, range(3), rank, world)
    return (
        before,
        frozen_fingerprint(par.model),
        bool(torch.equal(trained_before, par.model.blocks[1].ffn.w2.weight.full_tensor())),
    )


def test_a_frozen_block_stays_bit_identical_under_fsdp():
    for before, after, trainable_unchanged in spawn(_frozen):
        assert before == after
        assert not trainable_unchanged


def _uneven_eval(rank, world):
    par, _ = _fresh("fsdp", rank, world)
    prompts = [[1, 2, 3], [4, 5], [6]][: 3 if rank == 0 else 1]  # rank 0 samples three prompts, rank 1 one
    with par.evaluating():
        out = [par.model.generate(p, 4) for p in prompts]
    return out


def test_evaluation_under_fsdp_lets_ranks_sample_different_amounts():
    torch.manual_seed(0)
    plain = GPT(CFG)
    r0, r1 = spawn(_uneven_eval)
    assert r0 == [plain.generate(p, 4) for p in ([1, 2, 3], [4, 5], [6])]
    assert r1 == r0[:1]


class _Payload:
    """Unpickling this runs code: what a tampered checkpoint would carry."""

    def __reduce__(self):
        return (Path.touch, (Path(os.environ["GHOSTVIS_PAYLOAD"]),))


def test_a_tampered_dcp_metadata_file_is_refused_without_running_it(tmp_path, monkeypatch):
    import pickle

    model = GPT(CFG)
    opt = _optimizer(model)
    shards = ckpt.save_shards(tmp_path, 1, model, opt)  # one process, no process group
    path = ckpt.save(tmp_path, 1, model=model, optimizer=opt, state={"step": 1}, config={}, extra_dirs=shards)
    ckpt.load_model(path, GPT(CFG))  # the untampered one loads
    flag = tmp_path / "payload-ran"
    monkeypatch.setenv("GHOSTVIS_PAYLOAD", str(flag))
    (path / ckpt.DCP_DIR / ".metadata").write_bytes(pickle.dumps(_Payload()))
    with pytest.raises(ckpt.DamagedCheckpoint, match=r"dcp/\.metadata has sha256 .*, COMPLETE recorded"):
        ckpt.load_model(path, GPT(CFG))  # its hash is not the one committed
    ckpt.write_marker(path, 1)  # a forged marker that hashes the tampered file: the allow-list still refuses it
    with pytest.raises(GhostvisError, match="is not a DCP checkpoint's metadata"):
        ckpt.load_model(path, GPT(CFG))
    assert not flag.exists()


ASYNC_RUN = ["budget.steps=6", "checkpoint.every_steps=2", "parallel.strategy=fsdp"]


@pytest.mark.e2e
def test_the_trainer_with_async_checkpoints_trains_and_commits_like_the_sync_one(home_copy):
    """Two plain torchrun pretrains of 6 steps with a checkpoint every 2, fsdp on 2 ranks: sync, then
    checkpoint.async_save=true (the same identity, so a new attempt of the same run). Each async
    checkpoint is committed whole (both shards, metadata, ledger part, marker) and the final weights
    and ledger totals equal the sync run's."""
    from ghostvis_core.data.ledger import Ledger
    from ghostvis_core.home import Home
    from tests.conftest import run_cli, torchrun_stage

    for extra in ([], ["checkpoint.async_save=true"]):
        run_cli(
            torchrun_stage(home_copy, "pretrain", *ASYNC_RUN, *extra, OMP_NUM_THREADS="1"),
            home_copy,
            OMP_NUM_THREADS="1",
        )
    store = Home(home_copy).store
    ledger = Ledger.in_store(store)
    keys = sorted({p.run_key for p in ledger.parts(stage="pretrain") if p.step_last == 6})
    assert len(keys) == 2 and keys[0].endswith("-r1") and keys[1].endswith("-r2")
    sync_dir, async_dir = (store.fetch("checkpoints", "pretrain", k) for k in keys)
    refs = ckpt.list_complete(async_dir)
    assert [r.step for r in refs] == [4, 6] and not list(async_dir.glob(".dcp-*"))
    for r in refs:
        assert sorted(f.name for f in (r.path / ckpt.DCP_DIR).iterdir()) == [
            ".metadata",
            "__0_0.distcp",
            "__1_0.distcp",
        ]
        marker = ckpt.read_json(r.path, ckpt.MARKER)  # written after every rank's shard: it hashes them all
        assert (r.path / "ledger").is_dir() and marker["step"] == r.step
        assert {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp"} <= set(marker["sha256"])
    assert ledger.run_totals(keys[1]) == ledger.run_totals(keys[0])
    assert ledger.run_totals(keys[1]).counts.real_tokens == 6 * 4 * 256 * 2 and ledger.run_totals(keys[1]).parts == 3
    config = json.loads((refs[-1].path / "config.json").read_text())
    assert config["checkpoint"]["async_save"] is True and config["parallel"]["strategy"] == "fsdp"
    cfg = ModelConfig(**config["model"])
    sync_model, async_model = GPT(cfg), GPT(cfg)
    ckpt.load_model(ckpt.latest_complete(sync_dir).path, sync_model)
    ckpt.load_model(refs[-1].path, async_model)
    for (name, a), (_, b) in zip(sync_model.state_dict().items(), async_model.state_dict().items()):
        assert torch.equal(a, b), name


def _s3_node(rank: int, env: dict[str, str], cache: str):
    """This rank's view of the bucket store, with a cache of its own: as if each rank were a node."""
    from ghostvis_core.store import S3Store

    os.environ.update(env, GHOSTVIS_STORE_CACHE=cache)
    return S3Store.from_uri(env["GHOSTVIS_TEST_STORE"])


def _objects(store, step_dir: str) -> list[str]:
    """The files of a checkpoint in the bucket, as a client of the test's own lists them (not the store's)."""
    import boto3

    uri = store.uri_of("checkpoint", "pretrain", "run-r1", step_dir)
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    listing = boto3.client("s3").list_objects_v2(Bucket=bucket, Prefix=prefix + "/")
    return sorted(o["Key"][len(prefix) + 1 :] for o in listing.get("Contents", []))


def _write_through_s3(rank, world, env, tmp):
    """fsdp on 2 'nodes': each rank writes its shard into its own cache; `share_shard` uploads it,
    then rank 0 commits and publishes the rest, marker last."""
    from ghostvis_core.run.train.checkpoint_manager import share_shard

    store = _s3_node(rank, env, f"{tmp}/node{rank}")
    par, opt = _fresh("fsdp", rank, world)
    train_steps(par, opt, range(3), rank, world)
    run_dir = store.writable("checkpoints", "pretrain", "run-r1")
    shards = ckpt.save_shards(run_dir, 3, par.model, opt)
    share_shard(
        store, DistContext(rank, rank, world, torch.device("cpu")), "pretrain", "run-r1", 3, shards[ckpt.DCP_DIR]
    )
    before_marker = []
    if rank == 0:
        assert not (run_dir / ".dcp-step_000000003" / "__1_0.distcp").exists()  # rank 1 wrote in another cache
        before_marker = _objects(store, "step_000000003")
        commit(run_dir, par, opt, shards)
        store.publish("checkpoint", "pretrain", "run-r1", "step_000000003")
    dist.barrier()
    return train_steps(par, opt, range(3, 6), rank, world), before_marker


def test_fsdp_shards_from_ranks_with_their_own_caches_commit_through_s3(moto_s3, tmp_path):
    from tests.conftest import new_bucket, s3_env

    new_bucket(moto_s3, "fsdp")
    env = {**s3_env(moto_s3, tmp_path), "GHOSTVIS_TEST_STORE": "s3://fsdp/team"}
    saved = {k: os.environ.get(k) for k in [*env, "GHOSTVIS_STORE_CACHE"]}
    try:
        (uninterrupted, before_marker), _ = spawn(_write_through_s3, env, str(tmp_path))
        # every shard and the metadata reached the bucket before rank 0 published the rest
        assert before_marker == ["dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp"]
        reader = _s3_node(0, env, str(tmp_path / "node3"))  # a third node: nothing in its cache
        assert _objects(reader, "step_000000003") == [
            "COMPLETE",
            "config.json",
            "dcp/.metadata",
            "dcp/__0_0.distcp",
            "dcp/__1_0.distcp",
            "train_state.json",
        ]
        path = reader.fetch("checkpoint", "pretrain", "run-r1", "step_000000003")
        (state, on_two), _ = spawn(_resume, str(path))
        state1, on_one = _resume_single(str(path))
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    assert state == state1 == {"step": 3, "rows": 3 * ROWS_PER_STEP}
    assert on_two == pytest.approx(uninterrupted, rel=1e-6)
    assert on_one == pytest.approx(uninterrupted, rel=LOSS_RTOL)


def test_a_rank_drops_only_its_own_leftover_shards_and_the_emptied_staging_folder(tmp_path):
    from ghostvis_core.run.train.checkpoint_manager import drop_stale_shards

    staging = tmp_path / ".dcp-step_000000002"
    staging.mkdir()
    for name in ("__0_0.distcp", "__1_0.distcp"):
        (staging / name).write_bytes(b"x")
    drop_stale_shards(tmp_path, 1)
    assert sorted(f.name for f in staging.iterdir()) == ["__0_0.distcp"]  # rank 0's file is not rank 1's to drop
    drop_stale_shards(tmp_path, 0)
    assert not staging.exists()

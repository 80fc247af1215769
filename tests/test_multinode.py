"""Multi-node torchrun (launcher kind `torchrun`): the rendered per-node commands, ranks agreeing on
what each found in the store, and the short pretraining run as 2 nodes x 1 rank on this machine
(through the real dagster CLI, the second node started through node_shell) ending exactly where the
same run on one node with 2 ranks ends."""

from __future__ import annotations

import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

from ghostvis_core.data.ledger import Ledger
from ghostvis_core.errors import GhostvisError
from ghostvis_core.home import Home
from ghostvis_core.launch.cluster.torchrun_command import RDZV_PORT, MultiNode, node_line, torchrun_command
from ghostvis_core.run.train import checkpoint as ckpt
from ghostvis_core.run.train.dist import DistContext, agree
from ghostvis_core.runs.lookup import run_result
from tests.conftest import materialize_pretrain, new_run_dirs, reserved_port, run_cli, run_names

pytestmark = pytest.mark.e2e

# a node shell that needs no ssh server: the "other node" is a local shell (with {host} in its environment)
LOCAL_NODE_SHELL = "env GHOSTVIS_TEST_NODE={host} sh -c"


def test_each_node_gets_the_same_rendezvous_command_through_node_shell():
    multi = MultiNode(
        nnodes=3, rdzv_endpoint="10.0.0.1:29500", hosts=["10.0.0.2", "gpu-3"], node_shell="ssh -p 2222 {host}"
    )
    multi.check()
    rdzv = multi.rendezvous("pretrain-3f2a-r2", "1a2b3c4d-0")
    cmd = torchrun_command(
        "/shared/store/runs/pretrain/pretrain-3f2a-r2/spec.json", 4, rdzv, python="/opt/venv/bin/python"
    )
    env = {"OMP_NUM_THREADS": "8", "DAGSTER_PIPES_CONTEXT": "eJyrVkrLz1eyUkpKLFKqBQA="}
    line = node_line(cmd, env)
    for host in multi.hosts:
        argv = multi.node_argv(host, line)
        assert argv[:4] == ["ssh", "-p", "2222", host] and len(argv) == 5
        assert shlex.split(argv[4]) == [
            "exec",
            "env",
            "DAGSTER_PIPES_CONTEXT=eJyrVkrLz1eyUkpKLFKqBQA=",
            "OMP_NUM_THREADS=8",
            "/opt/venv/bin/python",
            "-m",
            "ghostvis_core.run.elastic_agent",
            "--nnodes=3",
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=10.0.0.1:29500",
            "--rdzv-id=pretrain-3f2a-r2-1a2b3c4d-0",
            "--nproc_per_node=4",
            "--signals-to-handle=SIGTERM,SIGINT,SIGUSR1,SIGUSR2",
            "--shutdown-timeout=120",
            "-m",
            "ghostvis_core.run",
            "--spec",
            "/shared/store/runs/pretrain/pretrain-3f2a-r2/spec.json",
        ]
    # no --node-rank: torchrun ranks the nodes as they arrive, so rank 0 may run on any node
    assert not any(a.startswith("--node-rank") for a in cmd)
    # defaults: this host's name on the usual port; every launch attempt its own rendezvous
    default = MultiNode(nnodes=2)
    assert default.rendezvous("pretrain-3f2a-r2", "a-0").endpoint == f"{socket.gethostname()}:{RDZV_PORT}"
    assert (
        default.rendezvous("pretrain-3f2a-r2", "a-0").rdzv_id != default.rendezvous("pretrain-3f2a-r2", "b-0").rdzv_id
    )


def test_ghostvis_prepare_prints_the_local_launchers_one_node_line():
    """The line `ghostvis prepare` prints is the local launcher's torchrun command, as a user types it."""
    from ghostvis_pipeline.prepare_command import torchrun_line

    spec = "/shared/store/runs/pretrain/pretrain-3f2a-r1/spec.json"
    assert torchrun_line(spec, 2, 45.0) == [
        "torchrun",
        *torchrun_command(spec, 2, grace_s=45.0)[3:],
    ]
    assert shlex.join(torchrun_line(spec, 2, 45.0)) == (
        "torchrun --standalone --nproc_per_node=2 --signals-to-handle=SIGTERM,SIGINT,SIGUSR1,SIGUSR2 "
        f"--shutdown-timeout=45 -m ghostvis_core.run --spec {spec}"
    )


def test_the_node_line_survives_the_node_shell_with_its_environment():
    value = "a b'c\"$HOME;"
    line = node_line(
        [sys.executable, "-c", "import os; print(os.environ['PROBE'], os.environ['GHOSTVIS_TEST_NODE'])"],
        {"PROBE": value},
    )
    argv = MultiNode(node_shell=LOCAL_NODE_SHELL).node_argv("node-7", line)
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    assert out == f"{value} node-7\n"


@pytest.mark.parametrize(
    "multi, names",
    [
        (MultiNode(nnodes=3, hosts=["b"]), ["hosts lists 1 node(s)", "nnodes=3", "2 other node(s)"]),
        (MultiNode(nnodes=1), ["nnodes=1", "kind 'local'"]),
        (MultiNode(node_shell="ssh {node}"), ["node_shell 'ssh {node}'", "{host}"]),
    ],
)
def test_a_launch_that_could_only_hang_is_refused(multi, names):
    with pytest.raises(GhostvisError) as err:
        multi.check()
    assert all(n in str(err.value) for n in names), str(err.value)


def _agree_rank(rank: int, init: str, out: Path) -> None:
    tdist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    ctx = DistContext(rank, rank, 2, torch.device("cpu"))
    try:
        assert agree(12, ctx, "the checkpoint step") == 12
        agree(12 if rank == 0 else 8, ctx, "the checkpoint step to resume from in /store/checkpoints/pretrain/r1")
        (out / f"rank{rank}.txt").write_text("agreed")
    except GhostvisError as exc:
        (out / f"rank{rank}.txt").write_text(str(exc))
    finally:
        tdist.destroy_process_group()


def test_ranks_that_see_different_checkpoints_stop_naming_both(tmp_path):
    mp.spawn(_agree_rank, args=(f"file://{tmp_path / 'rdzv'}", tmp_path), nprocs=2, join=True)
    messages = {(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)}
    assert len(messages) == 1  # every rank stops, with the same reason
    message = messages.pop()
    assert message.startswith(
        "ranks disagree on the checkpoint step to resume from in /store/checkpoints/pretrain/r1: "
        "rank 0 sees 12; rank 1 sees 8; every node must read the same store"
    )
    assert "GHOSTVIS_STORE=s3://" in message


def test_pretraining_on_two_nodes_ends_where_one_node_with_two_ranks_does(home_copy, pretrain_reference, monkeypatch):
    ref_home, ref_dir = pretrain_reference
    port = reserved_port()
    known = run_names(home_copy)
    run_cli(
        materialize_pretrain(
            kind="torchrun",
            torchrun={
                "nnodes": 2,
                "rdzv_endpoint": f"127.0.0.1:{port}",
                "hosts": ["127.0.0.1"],
                "node_shell": LOCAL_NODE_SHELL,
                "cpus_per_node": 1,
            },
        ),
        home_copy,
    )
    run_dir = new_run_dirs(home_copy, known)[-1]
    assert run_dir.name == ref_dir.name  # same config and data -> same run key

    store, ref_store = Home(home_copy).store, Home(ref_home).store
    done, ref = run_result(store, "pretrain", run_dir.name), run_result(ref_store, "pretrain", ref_dir.name)
    ledger, ref_ledger = Ledger.in_store(store), Ledger.in_store(ref_store)
    assert ledger.run_counts(run_dir.name) == ref_ledger.run_counts(ref_dir.name) == ref.counts == done.counts
    assert ledger.run_totals(run_dir.name) == ref_ledger.run_totals(ref_dir.name)
    assert done.steps == ref.steps == 12
    assert done.train_loss == ref.train_loss and done.val_loss == ref.val_loss
    final = ckpt.latest_complete(run_dir)
    assert final.step == 12
    assert (final.path / "model.safetensors").read_bytes() == (
        ckpt.latest_complete(ref_dir).path / "model.safetensors"
    ).read_bytes()

    nodes_sh = store.read_text("run_file", "pretrain", run_dir.name, "torchrun/nodes.sh")
    assert f"--rdzv-endpoint=127.0.0.1:{port}" in nodes_sh and "--nnodes=2" in nodes_sh
    from dagster import AssetKey, DagsterInstance

    monkeypatch.setenv("DAGSTER_HOME", str(home_copy / "dagster"))
    instance = DagsterInstance.get()
    event = instance.get_latest_materialization_event(AssetKey("pretrain"))
    assert event.asset_materialization.metadata["run_key"].value == run_dir.name
    # rank 0's progress lines reached Dagster through Pipes messages in the store
    logs = [e.user_message for e in instance.all_logs(event.run_id)]
    assert any("[pretrain] step 12/12" in m for m in logs), logs[-20:]
    nodes_uri = store.uri_of("run_file", "pretrain", run_dir.name, "torchrun/nodes.sh")
    assert any(f"`ghostvis store cat {nodes_uri} | sh`" in m for m in logs)  # the command a node fetches and runs

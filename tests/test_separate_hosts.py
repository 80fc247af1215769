"""The launchers on hosts that share nothing but an S3 bucket (issue 23): a Dagster host and two nodes,
each in its own network, mount and UTS namespace made by the test (tests/hosts.py), the store in a
bucket on an S3 server and MLflow a tracking server, both on the Dagster host. The prebuilt demo
home's store is moved into the bucket and deleted, so nothing can come from a folder. Every run ends
bit-identical to the same run on one machine with 2 ranks (`pretrain_reference`), and `ghostvis audit`
passes after it. The namespaces need root: without them the test fails, saying so; it never skips."""

from __future__ import annotations

import json
import re
import secrets
import time
from datetime import datetime
from pathlib import Path

import pytest

from ghostvis_core.data.ledger import Ledger
from ghostvis_core.run.train import checkpoint as ckpt
from ghostvis_core.runs.lookup import run_result
from ghostvis_core.store import open_store
from tests.conftest import BIN, copy_home, materialize_pretrain
from tests.faults import SOAK_HANG_S, run_soak
from tests.hosts import (
    HOST_ADDR,
    another_home,
    make_hosts,
    move_store_to_bucket,
    slurm_placement,
    start_servers,
)
from tests.slurm_cluster import start_cluster

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def hosts(demo_home, module_tmp):
    """One set of hosts for the module: servers up, the demo home's store in the bucket."""
    hosts = make_hosts(module_tmp("hosts"), secret=f"gvFakeSecret{secrets.token_hex(12)}")
    try:
        copy_home(demo_home, hosts.home)
        start_servers(hosts)
        move_store_to_bucket(hosts)
        yield hosts
    finally:
        hosts.stop()


def weights(run_dir: Path) -> bytes:
    return (ckpt.latest_complete(run_dir).path / "model.safetensors").read_bytes()


def new_run(hosts, store_uri: str, demo_home: Path, dest: Path) -> tuple[Path, Path]:
    """The store's pretraining runs as a folder, and the one run in it that the demo had not."""
    store_dir = hosts.download(store_uri, dest, "checkpoints/pretrain", "runs/pretrain")
    known = {p.name for p in (demo_home / "store" / "checkpoints" / "pretrain").iterdir()}
    (run_key,) = {p.name for p in (store_dir / "checkpoints" / "pretrain").iterdir()} - known
    return store_dir, store_dir / "checkpoints" / "pretrain" / run_key


def assert_same_run(store_dir: Path, run_dir: Path, reference: tuple[Path, Path]) -> None:
    """The run ended exactly where the local 2-rank run did: same key, figures and weights."""
    ref_home, ref_dir = reference
    assert run_dir.name == ref_dir.name  # same config and data -> same run key
    done, ref = (
        run_result(open_store(str(store_dir)), "pretrain", run_dir.name),
        run_result(open_store(str(ref_home / "store")), "pretrain", ref_dir.name),
    )
    assert done.steps == ref.steps == 12 and done.counts == ref.counts
    assert done.train_loss == ref.train_loss and done.val_loss == ref.val_loss
    assert weights(run_dir) == weights(ref_dir)


def compute_logs(home: Path, dagster_output: str) -> str:
    """The stderr of the Dagster run's steps (what the processes they start print: torchrun's output)."""
    run_id = re.search(r"__ASSET_JOB - ([0-9a-f-]{36}) - ", dagster_output)[1]
    return "".join(p.read_text() for p in sorted((home / "dagster" / "storage" / run_id).rglob("*.err")))


def assert_audit_passes(hosts, home: Path, store_uri: str) -> None:
    audit = hosts.run(["ghostvis", "audit", "--stage", "pretrain"], home, check=False, GHOSTVIS_STORE=store_uri)
    assert audit.returncode == 0, audit.stdout[-4000:] + audit.stderr[-4000:]


def test_torchrun_on_two_nodes_with_rank_0_away_from_the_dagster_host(hosts, demo_home, pretrain_reference, tmp_path):
    proc = hosts.run(materialize_pretrain(**torchrun_on_gv1(hosts)))
    store_dir, run_dir = new_run(hosts, hosts.store_uri, demo_home, tmp_path / "bucket")
    assert_same_run(store_dir, run_dir, pretrain_reference)
    # rank 0 ran on gv1: torchrun's rendezvous names its host the master, and rank 0 (which writes the
    # checkpoints) published the final step from gv1's own store cache
    torchrun_output = compute_logs(hosts.home, proc.stderr)
    assert "master_addr=gv1" in torchrun_output and "master_addr=gvhost" not in torchrun_output, torchrun_output[-3000:]
    step = f"checkpoints/pretrain/{run_dir.name}/{ckpt.latest_complete(run_dir).path.name}/model.safetensors"
    assert list(hosts.cache("gv1").rglob(step)), sorted(hosts.cache("gv1").rglob("*"))[:20]
    assert not (hosts.home / "store").exists(), proc.stdout[-2000:]
    assert_audit_passes(hosts, hosts.home, hosts.store_uri)


def torchrun_on_gv1(hosts) -> dict:
    """The torchrun launcher: the Dagster host and gv1, 1 rank each (gv1 gets rank 0: see tests/hosts.py)."""
    return {
        "kind": "torchrun",
        "torchrun": {
            "nnodes": 2,
            "rdzv_endpoint": f"{HOST_ADDR}:29400",
            "hosts": ["gv1"],
            "node_shell": f"{hosts.nodesh} {{host}}",
            "cpus_per_node": 1,
        },
    }


def wait_for_key(hosts, key: str, proc, log: Path, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while key not in hosts.keys(key):
        assert proc.poll() is None, f"the run ended ({proc.returncode}) before {key}:\n{log.read_text()[-4000:]}"
        assert time.time() < deadline, f"no {key} within {timeout} s:\n{log.read_text()[-4000:]}"
        time.sleep(2)


def soak_config(hosts) -> list[str]:
    """`dagster asset materialize` of the short pretraining run on two hosts, with the soak's hang timeout."""
    argv = materialize_pretrain(**torchrun_on_gv1(hosts))
    config = json.loads(argv[-1])
    config["ops"]["pretrain"]["config"]["overrides"]["runtime.hang_timeout_s"] = str(SOAK_HANG_S)
    return [*argv[:-1], json.dumps(config)]


def test_a_fault_soak_ends_bitwise_where_the_undisturbed_run_does_with_every_token_once(
    hosts, demo_home, pretrain_reference, tmp_path
):
    """Six faults of different kinds in one materialization across two hosts (S3 store, MLflow server): a second
    launch of the same identity, a 30 s S3 outage, a rank SIGKILLed, a preemption (SIGTERM), a hang (SIGSTOP) and
    rank 0's node killed. The run ends bitwise where the undisturbed run does, the ledger's parts tile its 12 steps
    once, one MLflow run, the audit passes; the second launch is a cache hit naming the run; the preemption used
    no retry and the three faults the three retries; `ghostvis goodput` accounts for the wall the test measured."""
    home, store = another_home(hosts, demo_home, "soak")
    run_key, logs = pretrain_reference[1].name, (tmp_path / "first.log", tmp_path / "second.log")
    wall_s = run_soak(hosts, soak_config(hosts), home, store, run_key, logs)
    out = logs[0].read_text()
    assert out.count("STEP_UP_FOR_RETRY") == 3 and out.count("launching again") == 1, out[-4000:]
    assert re.search(
        r"hung: rank 0 on gv1 made no progress for \d+ s after step \d+ .*rank stopped: rank 1 on gvhost", out
    )
    assert re.search(rf"pretrain: cache hit, identity \S+ equals that of completed run {run_key}", logs[1].read_text())
    store_dir, run_dir = new_run(hosts, store, demo_home, tmp_path / "bucket")
    assert_same_run(store_dir, run_dir, pretrain_reference)
    hosts.download(store, tmp_path / "bucket", "ledger")
    done = run_result(open_store(str(store_dir)), "pretrain", run_key)
    assert out.count(": resume from step") == 4  # five launches: killed, preempted, hung, node lost, done
    chain = Ledger.in_store(open_store(str(store_dir))).chain(run_key)
    assert [p.step_first for p in chain] == [1] + [p.step_last + 1 for p in chain[:-1]]
    assert chain[-1].step_last == 12 and {p.mlflow_run_id for p in chain} == {done.mlflow_run_id}
    assert_audit_passes(hosts, home, store)
    assert_goodput_adds_up(hosts, home, store, store_dir / "ledger", run_key, (out, wall_s))


def step_wall_s(dagster_log: str) -> float:
    """The pretrain step's wall as Dagster logged it (to the second): its first attempt's start to its
    materialization."""
    stamps = re.findall(
        r"^(\S+ \S+) \+0000 - dagster - .* - pretrain - (STEP_START|ASSET_MATERIALIZATION) ", dagster_log, re.M
    )
    start = next(t for t, what in stamps if what == "STEP_START")
    end = next(t for t, what in stamps if what == "ASSET_MATERIALIZATION")
    return (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds()


def assert_goodput_adds_up(hosts, home: Path, store: str, ledger: Path, run_key: str, measured: tuple) -> None:
    """`ghostvis goodput --run` on the bucket's ledger: its categories add up to the step's wall as Dagster logged it
    within 2% (and the second of the log's resolution), every part of the chain has its committed steps in the
    timeline, and its redone steps are the ledger's, counted here in DuckDB: per step, the launches that computed it
    less the one that kept it. (`measured`: the Dagster output and the wall the test measured around the command,
    which also holds Dagster's own start and the stage's checks.)"""
    import duckdb

    out = hosts.run(["ghostvis", "goodput", "--run", run_key, "--json"], home, GHOSTVIS_STORE=store)
    (g,) = json.loads(out.stdout)
    wall_s = step_wall_s(measured[0])
    print(json.dumps(g), f"step wall {wall_s:.0f} s, command wall {measured[1]:.1f} s")
    assert abs(sum(g["seconds"].values()) - wall_s) <= 0.02 * wall_s + 1, (g, wall_s)
    assert g["launches"] == 5 and g["productive_steps"] == 12, g
    assert g["goodput"] == pytest.approx(g["seconds"]["productive"] / g["wall_s"], abs=1e-4)
    folder = f"stage=pretrain/run={run_key}/*.parquet"
    steps = f"(SELECT * FROM read_parquet('{ledger}/timeline/{folder}') WHERE kind = 'steps')"
    parts = f"read_parquet('{ledger}/parts/{folder}')"
    con = duckdb.connect()
    unmatched = con.execute(
        f"SELECT count(*) FROM {parts} p ANTI JOIN (SELECT * FROM {steps} WHERE reason = 'committed') s "
        "ON p.segment = s.segment AND p.step_first = s.step_first AND p.step_last = s.step_last"
    ).fetchone()[0]
    computed, distinct = con.execute(
        f"SELECT count(*), count(DISTINCT r.step) FROM range(1, 13) r(step) JOIN {steps} s "
        "ON r.step BETWEEN s.step_first AND s.step_last"
    ).fetchone()
    assert unmatched == 0 and distinct == 12
    assert g["redone_steps"] == computed - distinct, (g, computed)


@pytest.fixture(scope="module")
def slurm_on_hosts(hosts):
    """slurmctld on the Dagster host, a slurmd on each node (tests/slurm_cluster.py, placed by tests/hosts.py)."""
    cluster = start_cluster(slurm_placement(hosts))
    try:
        yield cluster
    finally:
        cluster.stop()


def test_slurm_on_two_nodes_with_the_batch_step_away_from_the_dagster_host(
    hosts, slurm_on_hosts, demo_home, pretrain_reference, tmp_path
):
    home, store = another_home(hosts, demo_home, "slurm")
    (hosts.root / "job-output").mkdir()  # the batch node's own copy of the job's output (looked at for secrets)
    proc = hosts.run(
        materialize_pretrain(
            kind="slurm",
            send_credentials=False,
            slurm={
                "nodes": 2,
                "cpus_per_task": 1,
                "poll_seconds": 1,
                "python": str(BIN / "python"),
                "output": f"{hosts.root}/job-output/%j.out",
            },
        ),
        home,
        GHOSTVIS_STORE=store,
        SLURM_CONF=str(slurm_on_hosts.conf),
    )
    store_dir, run_dir = new_run(hosts, store, demo_home, tmp_path / "bucket")
    assert_same_run(store_dir, run_dir, pretrain_reference)
    # the job's output, written on the batch node gv1, reached the Dagster log through the store:
    # torchrun's rendezvous lines are in no other output
    assert "Rendezvous complete for workers" in proc.stderr and "master_addr=gv1" in proc.stderr, proc.stderr[-4000:]
    assert not (home / "store").exists()
    assert_audit_passes(hosts, home, store)


def files_holding(text: str, *roots: Path, skip: tuple[Path, ...] = ()) -> list[Path]:
    """The files (`roots`, or the files under them) whose bytes contain `text`."""
    needle = text.encode()
    files = [p for root in roots for p in ([root] if root.is_file() else root.rglob("*"))]
    return [p for p in files if p.is_file() and not p.is_symlink() and p not in skip and needle in p.read_bytes()]


def test_the_secret_is_in_no_file_of_the_home_the_bucket_mlflow_or_the_job_outputs(hosts, slurm_on_hosts):
    """Runs after the runs above: the Dagster host had AWS_SECRET_ACCESS_KEY in its environment, the
    nodes in their own credentials files, and the Slurm launcher was told not to send credentials."""
    job_outputs = sorted((hosts.root / "job-output").glob("*.out"))
    shipped = [key for key in hosts.keys("slurm/store/runs/pretrain/") if "/slurm/" in key and "/out/" in key]
    assert job_outputs and shipped and (hosts.home / "mlflow.db").exists()  # there is something to look in
    credentials = tuple(hosts.root / node / "home" / ".aws" / "credentials" for node in ("gv1", "gv2"))
    assert files_holding(hosts.secret, *credentials) == list(credentials)  # the search finds it where it is
    # the homes (Dagster storage, MLflow's store, logs), every host's cache and job output, the
    # servers' logs, Slurm's state and spool; then every object of the bucket
    assert files_holding(hosts.secret, hosts.root, slurm_on_hosts.root, skip=credentials) == []
    assert hosts.keys_holding(hosts.secret) == []


def test_one_writer_on_s3_through_a_paused_launch_and_a_store_outage(hosts, demo_home, tmp_path):
    """The S3 store, two nodes, `runtime.lease_expiry_s=8`: launch A's every process (the Dagster host's and gv1's)
    is paused past the expiry; launch B takes over and resumes; A wakes and stops `lease lost`, committing nothing.
    Then, while B trains, launch C waits for the lease and the S3 server stops answering for longer than the
    expiry: one launch goes on, the others stop `lease lost` or are cache hits. The parts tile steps 1..16 once, in
    one MLflow run, and the audit passes."""
    import signal

    import psutil

    from ghostvis_core.runs.lookup import identity_of
    from tests.faults import outage, wait_for

    home, store = another_home(hosts, demo_home, "fence")
    prefix = store.split("/", 3)[3]
    argv = materialize_pretrain(**torchrun_on_gv1(hosts))
    config = json.loads(argv[-1])
    config["ops"]["pretrain"]["config"]["overrides"].update(
        {"budget.steps": "16", "runtime.lease_expiry_s": "8", "runtime.hang_timeout_s": str(SOAK_HANG_S)}
    )
    argv = [*argv[:-1], json.dumps(config)]
    logs = [tmp_path / f"{name}.log" for name in "abc"]
    known = {k.split("/")[-3] for k in hosts.keys(f"{prefix}/checkpoints/pretrain/") if k.endswith("/COMPLETE")}
    a = hosts.start(argv, logs[0], home, GHOSTVIS_STORE=store)
    launches = [a]
    try:
        step4 = wait_for(
            "step 4's checkpoint",
            lambda: [
                k
                for k in hosts.keys(f"{prefix}/checkpoints/pretrain/")
                if k.endswith("/step_000000004/COMPLETE") and k.split("/")[-3] not in known
            ],
            a,
            logs[0],
        )
        run_key = step4[0].split("/")[-3]
        leases = f"{prefix}/leases/pretrain/{identity_of(run_key)}/"
        tree = [psutil.Process(a.pid), *psutil.Process(a.pid).children(recursive=True)]
        for p in tree:
            p.send_signal(signal.SIGSTOP)
        before = {k for k in hosts.keys(leases) if k.endswith("holder.json")}
        time.sleep(10)
        b = hosts.start(argv, logs[1], home, GHOSTVIS_STORE=store)
        launches.append(b)
        wait_for(
            "B's takeover", lambda: {k for k in hosts.keys(leases) if k.endswith("holder.json")} - before, b, logs[1]
        )
        for p in tree:
            p.send_signal(signal.SIGCONT)
        c = hosts.start(argv, logs[2], home, GHOSTVIS_STORE=store)  # while B trains: C waits for the lease
        launches.append(c)
        wait_for("C waiting", lambda: "waiting for Dagster run" in logs[2].read_text(), c, logs[2])
        outage(hosts.services[0].pid, 12)  # past the 8 s expiry while C waits
        ends = [proc.wait(timeout=900) for proc in (a, b, c)]
    finally:
        for proc in launches:
            if proc.poll() is None:
                proc.kill()
    outs = [log.read_text() for log in logs]
    assert "taken over by Dagster run" in outs[0], outs[0][-4000:]  # A's rank stopped at its fence
    # A ends `lease lost`; or, when its node's exit reached the launcher before rank 0's reason reached the store,
    # the stage's retry waits for the lease like C. A waiting launch (A's retry or C) takes the lease when the
    # outage leaves B's heartbeat older than the expiry, and B stops `lease lost`; a launch that waits to the end
    # is a cache hit. Seen: B going on, C going on, and A's retry going on. Whatever the order, every launch ends 0
    # or `lease lost`, and nothing but one writer commits (the parts' tiling below).
    assert 0 in ends and all(e == 0 or "lease lost" in o for e, o in zip(ends, outs, strict=True)), outs
    store_dir = hosts.download(store, tmp_path / "bucket", "checkpoints/pretrain", "runs/pretrain", "ledger")
    done = run_result(open_store(str(store_dir)), "pretrain", run_key)
    chain = Ledger.in_store(open_store(str(store_dir))).chain(run_key)
    assert [p.step_first for p in chain] == [1] + [p.step_last + 1 for p in chain[:-1]], chain
    assert chain[-1].step_last == done.steps == 16 and {p.mlflow_run_id for p in chain} == {done.mlflow_run_id}
    assert_audit_passes(hosts, home, store)

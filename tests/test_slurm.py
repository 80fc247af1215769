"""The `slurm` launcher: its sbatch script and state mapping (fast), and end to end through the dagster
CLI on a real Slurm cluster on this machine (tests/slurm_cluster.py: munged, slurmctld, two slurmd).

The short pretraining run (2 ranks) runs as 2 nodes x 1 rank in one sbatch job and must end bitwise
where the same run through the local launcher ends (`pretrain_reference`); a second run is cancelled
with `scancel` after its first checkpoint and resumed by re-materializing."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import boto3
import psutil
import pytest

from ghostvis_core.data.ledger import Ledger
from ghostvis_core.errors import GhostvisError
from ghostvis_core.home import Home
from ghostvis_core.launch.cluster.slurm_script import (
    JOB_OUTCOMES,
    SlurmJob,
    job_outcome,
    redact,
    render_sbatch,
    ship_command,
)
from ghostvis_core.run.train import checkpoint as ckpt
from ghostvis_core.runs.lookup import run_result
from ghostvis_core.store import open_store
from ghostvis_core.verify.eval.eval_spec import EvalSpec, eval_job
from tests.conftest import (
    BIN,
    cli_env,
    materialize,
    materialize_pretrain,
    new_run_dirs,
    reserved_port,
    run_cli,
    run_names,
    s3_env,
)
from tests.faults import T, wait_for
from tests.hosts import keep_pretrain_checkpoints_only, upload
from tests.slurm_cluster import slurm_cluster  # noqa: F401 (a fixture)

SPEC = "s3://team/store/runs/pretrain/pretrain-abc-r1/spec.json"
SHIP = ship_command(SlurmJob(), "s3://team/store", "pretrain", "pretrain-abc-r1", "slurm/a1/out")
# One materialization is a few minutes here: the dagster CLI starts a process per step (the stage and
# its four checks), each importing torch, on a machine that others share.
MATERIALIZE_TIMEOUT = 1200


def script_lines(job: SlurmJob, env: dict[str, str] | None = None, nproc: int = 4) -> list[str]:
    return render_sbatch(job, SPEC, nproc, env or {"OMP_NUM_THREADS": "4"}, SHIP).splitlines()


def test_sbatch_script_asks_for_the_job_and_starts_torchrun_once_per_node():
    job = SlurmJob(
        nodes=4,
        gpus_per_node=8,
        cpus_per_task=64,
        mem="480G",
        time="12:00:00",
        partition="gpu",
        account="llm",
        qos="high",
        rdzv_port=29555,
        python="/opt/venv/bin/python",
    )
    lines = script_lines(job, nproc=8)
    assert lines[0] == "#!/bin/bash"
    assert [line for line in lines if line.startswith("#SBATCH")] == [
        "#SBATCH --job-name=ghostvis",
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --output=/tmp/ghostvis-slurm-%j.out",
        "#SBATCH --export=ALL",
        "#SBATCH --no-requeue",
        "#SBATCH --signal=TERM@130",  # runtime.preempt_grace_s (120) and torchrun's own exit (10)
        "#SBATCH --cpus-per-task=64",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --mem=480G",
        "#SBATCH --time=12:00:00",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=llm",
        "#SBATCH --qos=high",
    ]
    srun = [line for line in lines if line.startswith("srun ")]
    assert srun == [
        'srun --kill-on-bad-exit=1 /opt/venv/bin/python -m ghostvis_core.run.elastic_agent --nnodes="$SLURM_NNODES" '
        '--rdzv-backend=c10d --rdzv-endpoint="$rdzv_host":29555 --rdzv-id="$SLURM_JOB_ID" '
        "--nproc_per_node=8 --signals-to-handle=SIGTERM,SIGINT,SIGUSR1,SIGUSR2 --shutdown-timeout=120 "
        f"-m ghostvis_core.run --spec {SPEC}"
    ]
    assert 'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)' in lines
    assert lines.index("export OMP_NUM_THREADS=4") < lines.index(srun[0])
    # everything from the rendezvous lookup to srun's end goes through the shipper, to the store
    assert (
        lines.index("{")
        < lines.index(srun[0])
        < lines.index(
            "} 2>&1 | python -m ghostvis_core.run.ship_output --store s3://team/store --stage pretrain "
            "--run-key pretrain-abc-r1 --name slurm/a1/out"
        )
    )


def test_one_grace_setting_gives_torchrun_its_wait_and_slurm_its_early_signal():
    """runtime.preempt_grace_s is the one setting: torchrun waits that long for its ranks after passing a stop
    signal on, and Slurm signals the step that long plus torchrun's exit before the time limit; no limit, no
    early signal."""
    lines = render_sbatch(SlurmJob(time="1:00:00"), SPEC, 2, {}, SHIP, grace_s=45.5).splitlines()
    assert "#SBATCH --signal=TERM@56" in lines
    (srun,) = [line for line in lines if line.startswith("srun ")]
    assert " --signals-to-handle=SIGTERM,SIGINT,SIGUSR1,SIGUSR2 --shutdown-timeout=46 -m ghostvis_core.run " in srun
    assert not [line for line in script_lines(SlurmJob()) if "--signal" in line and "SBATCH" in line]


def test_defaults_leave_the_cluster_defaults_and_ask_for_one_cpu_node():
    sbatch = [line for line in script_lines(SlurmJob()) if line.startswith("#SBATCH")]
    assert "#SBATCH --nodes=1" in sbatch and "#SBATCH --cpus-per-task=8" in sbatch
    assert not [
        line
        for line in sbatch
        if line.startswith(
            (
                "#SBATCH --gpus",
                "#SBATCH --mem",
                "#SBATCH --time",
                "#SBATCH --partition",
                "#SBATCH --account",
                "#SBATCH --qos",
            )
        )
    ]


def test_the_evaluation_job_is_one_rank_on_one_node_of_a_four_node_launcher(tmp_path):
    """Rendered as training's job script is (launchers/slurm.py job_script), its command the evaluation's module."""
    from dagster import build_resources

    from ghostvis_pipeline.launchers import Launcher
    from ghostvis_pipeline.launchers.slurm import job_script, slurm_job

    config = {"kind": "slurm", "slurm": {"nodes": 4, "gpus_per_node": 8, "partition": "gpu"}}
    with build_resources(
        {"launcher": Launcher.configure_at_launch()}, resource_config={"launcher": {"config": config}}
    ) as r:
        launcher = r.launcher
    target = eval_job(EvalSpec("ev1d", "", "http://mlflow:5000", "tok", {"sft": "sft-2-r1"}, {}, [], []))
    home = Home(tmp_path / "home")
    job = slurm_job(launcher, target)
    lines = job_script(home, target, job, launcher.ranks_per_node(target), {}, "slurm/a1/out").splitlines()
    assert {"#SBATCH --nodes=1", "#SBATCH --gpus-per-node=1", "#SBATCH --partition=gpu"} <= set(lines)
    (srun,) = [line for line in lines if line.startswith("srun ")]
    spec = home.store.uri_of("run_spec", "evaluation", "ev1d")
    assert "--nproc_per_node=1 " in srun and srun.endswith(f" -m ghostvis_core.verify.eval --spec {spec}")


def test_extra_sbatch_options_and_setup_lines_come_in_order_before_srun():
    job = SlurmJob(
        nodes=2,
        extra_sbatch=["--exclusive", "--constraint=a100"],
        setup=["module load cuda/12.4", "source /opt/venv/bin/activate"],
    )
    lines = script_lines(job)
    sbatch = [line for line in lines if line.startswith("#SBATCH")]
    assert sbatch[-2:] == ["#SBATCH --exclusive", "#SBATCH --constraint=a100"]
    setup = [lines.index("module load cuda/12.4"), lines.index("source /opt/venv/bin/activate")]
    srun = next(i for i, line in enumerate(lines) if line.startswith("srun "))
    assert setup[0] < setup[1] < srun
    assert lines.index("set -eo pipefail") < setup[0]


def test_an_extra_line_that_is_not_an_sbatch_option_is_refused_with_the_fix():
    with pytest.raises(GhostvisError, match=r"extra_sbatch entry '#SBATCH --exclusive'.*'--constraint=a100'"):
        render_sbatch(SlurmJob(extra_sbatch=["#SBATCH --exclusive"]), SPEC, 1, {}, SHIP)


def test_paths_with_spaces_are_quoted_for_bash():
    lines = render_sbatch(
        SlurmJob(output="/data/my runs/a.out"), "/data/my runs/spec.json", 1, {"X": "a b"}, SHIP
    ).splitlines()
    assert "#SBATCH '--output=/data/my runs/a.out'" in lines and "export X='a b'" in lines
    srun = next(line for line in lines if line.startswith("srun "))
    assert shlex.split(srun)[-2:] == ["--spec", "/data/my runs/spec.json"]


def test_secrets_never_enter_the_script_and_are_redacted_in_logs():
    env = {
        "OMP_NUM_THREADS": "1",
        "AWS_ACCESS_KEY_ID": "AKIAEXAMPLE",
        "AWS_SECRET_ACCESS_KEY": "s3cr3t/value",
        "MLFLOW_TRACKING_TOKEN": "tok-123",
        "DAGSTER_PIPES_MESSAGES": "eyJwYXRoIjogIi9zIn0=",
    }
    script = "\n".join(script_lines(SlurmJob(setup=["export HF_TOKEN=hf_abc"]), env))
    assert "s3cr3t/value" not in script and "tok-123" not in script and "AKIAEXAMPLE" not in script
    assert "export DAGSTER_PIPES_MESSAGES=eyJwYXRoIjogIi9zIn0=" in script  # Pipes bootstrap: not a secret
    logged = redact(script)
    assert "hf_abc" not in logged and "export HF_TOKEN=***" in logged
    assert redact("AWS_SECRET_ACCESS_KEY='a b' OMP_NUM_THREADS=2") == "AWS_SECRET_ACCESS_KEY=*** OMP_NUM_THREADS=2"
    assert redact("start; tokens_per_step=4096") == "start; tokens_per_step=4096"  # job output, not a variable


def test_job_states_map_to_outcomes():
    assert job_outcome("COMPLETED") == "ok"
    assert [job_outcome(s) for s in ("TIMEOUT", "PREEMPTED", "NODE_FAIL")] == ["resumable"] * 3
    assert [job_outcome(s) for s in ("FAILED", "CANCELLED", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")] == ["failed"] * 5
    assert job_outcome("CANCELLED by 0") == "failed"  # sacct's spelling
    assert [job_outcome(s) for s in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED")] == [None] * 5
    assert job_outcome("SPECIAL_EXIT") == "failed"  # a final state nobody listed is not success
    assert set(JOB_OUTCOMES.values()) == {"ok", "resumable", "failed"}


# ---------------------------------------------------------------- end to end, on the real cluster


@pytest.mark.e2e
def test_the_test_cluster_runs_one_step_on_both_nodes(slurm_cluster):
    """The cluster itself (tests/slurm_cluster.py), before anything trains on it."""
    proc = slurm_cluster.run("srun", "-N2", "bash", "-c", 'echo "$SLURMD_NODENAME $SLURM_NNODES"')
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == ["gv1 2", "gv2 2"]


def slurm_launcher(**extra) -> dict:
    """The launcher config of the e2e runs: 2 nodes x 1 rank (the smoke preset's world size is 2), one
    core per node's ranks like the reference's one thread per rank, the venv activated by `setup`, no
    output file on the batch node (the output travels through the store)."""
    slurm = {
        "nodes": 2,
        "cpus_per_task": 1,
        "setup": [f"source {BIN / 'activate'}"],
        "output": "/dev/null",
        "rdzv_port": reserved_port(),
        "poll_seconds": 1.0,
        **extra,
    }
    return {"kind": "slurm", "slurm": slurm}


def assert_same_run(home: Path, run_dir: Path, reference: tuple[Path, Path]) -> Ledger:
    """The run ended exactly where the reference ended: ledger totals, losses, final weights."""
    ref_home, ref_dir = reference
    assert run_dir.name == ref_dir.name  # same config and data -> same run key, whatever the launcher
    done = run_result(Home(home).store, "pretrain", run_dir.name)
    ref = run_result(Home(ref_home).store, "pretrain", ref_dir.name)
    ledger, ref_ledger = Ledger.in_store(Home(home).store), Ledger.in_store(Home(ref_home).store)
    assert ledger.run_counts(run_dir.name) == ref_ledger.run_counts(ref_dir.name) == done.counts == ref.counts
    totals, ref_totals = ledger.run_totals(run_dir.name), ref_ledger.run_totals(ref_dir.name)
    # a resumed run has more segments, and a preempted one a part more (the checkpoint of the step it stopped at)
    assert replace(totals, segments=(), parts=0) == replace(ref_totals, segments=(), parts=0)
    assert done.train_loss == ref.train_loss and done.val_loss == ref.val_loss
    weights = (ckpt.latest_complete(run_dir).path / "model.safetensors").read_bytes()
    assert weights == (ckpt.latest_complete(ref_dir).path / "model.safetensors").read_bytes()
    return ledger


@pytest.mark.e2e
def test_a_cancelled_two_node_slurm_job_fails_and_rematerializing_resumes_through_a_preemption_to_the_local_run(
    slurm_cluster, home_copy, pretrain_reference
):
    launcher = slurm_launcher()
    known = run_names(home_copy)
    log_path = home_copy.parent / "materialize.log"
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(
            [str(BIN / "dagster"), *materialize_pretrain(**launcher)[1:]],
            env=cli_env(home_copy),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            cwd=Path(__file__).resolve().parent.parent,
        )
    run_dir = wait_for_checkpoint(home_copy, known, 4, proc, log_path)
    [job_id] = slurm_cluster.run("squeue", "-h", "-o", "%i").stdout.split()
    assert slurm_cluster.run("scancel", job_id).returncode == 0
    assert proc.wait(timeout=MATERIALIZE_TIMEOUT) != 0
    log = log_path.read_text()
    assert f"Slurm job {job_id} ended CANCELLED" in log
    assert not Home(home_copy).store.exists("run_record", "pretrain", run_dir.name)
    assert 4 <= ckpt.latest_complete(run_dir).step < 12

    # re-materialize: the cancelled run is found and resumed from its newest checkpoint, as a second 2-node job,
    # which Slurm then preempts (`scancel --signal=TERM`, what `--signal=TERM@s` does before the time limit): the
    # ranks commit the step they are at and exit `preempted`, the launcher submits a third job at once (no retry),
    # and the run ends exactly where the uninterrupted local 2-rank run ends
    resumed_from, relaunched = ckpt.latest_complete(run_dir).step, time.time()
    argv = materialize_pretrain(**launcher)
    config = json.loads(argv[-1])
    config["ops"]["pretrain"]["config"]["overrides"]["runtime.hang_timeout_s"] = "16"  # a heartbeat every 2 s
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(
            [str(BIN / "dagster"), *argv[1:-1], json.dumps(config)],
            env=cli_env(home_copy),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            cwd=Path(__file__).resolve().parent.parent,
        )
    store = Home(home_copy).store

    def training_again() -> bool:  # rank 0 of the new job beats past the checkpoint it resumed from
        beat = ("run_file", "pretrain", run_dir.name, "heartbeats/rank0.json")
        if not store.exists(*beat):
            return False
        data = store.read_json(*beat)
        return data["time"] > relaunched and data["step"] > resumed_from

    wait_for("the resumed job's first step", training_again, proc, log_path, timeout=MATERIALIZE_TIMEOUT)
    [job_id] = slurm_cluster.run("squeue", "-h", "-o", "%i").stdout.split()
    assert slurm_cluster.run("scancel", "--signal=TERM", job_id).returncode == 0
    assert proc.wait(timeout=MATERIALIZE_TIMEOUT) == 0, log_path.read_text()[-6000:]
    log = log_path.read_text()
    preempted = int(re.search(r"preempted at step (\d+)", log).group(1))
    assert resumed_from < preempted < 12 and "launching again" in log and "STEP_UP_FOR_RETRY" not in log
    ledger = assert_same_run(home_copy, run_dir, pretrain_reference)
    chain = ledger.chain(run_dir.name)
    assert sorted({p.segment for p in chain}) == [0, 1, 2]
    assert any(p.step_last == preempted for p in chain) and any(p.step_first == preempted + 1 for p in chain)
    assert run_result(store, "pretrain", run_dir.name).segment == 2
    scripts = slurm_scripts(store, run_dir.name)
    assert len(scripts) == 3
    script = store.read_text("run_file", "pretrain", run_dir.name, scripts[-1])
    assert "#SBATCH --nodes=2" in script and "srun " in script
    last = [line for line in shipped_output(store, run_dir.name, scripts[-1]).splitlines() if line.strip()][-1]
    assert last in log  # the job's output reached the Dagster log


def slurm_scripts(store, run_key: str) -> list[str]:
    """The run's sbatch scripts in the store (`run_file` names), oldest first."""
    return [key[2] for key in store.keys("run_file", "pretrain", run_key) if key[2].endswith(".sbatch")]


def shipped_output(store, run_key: str, script: str) -> str:
    """The output the batch node shipped to the store for the job of `script` (its chunks, in order)."""
    out = script.removesuffix(".sbatch") + "/out/"
    chunks = sorted(key[2] for key in store.keys("run_file", "pretrain", run_key) if key[2].startswith(out))
    assert chunks, f"no output chunks under {out}"
    return "".join(store.read_text("run_file", "pretrain", run_key, name) for name in chunks)


FAKE_KEY_ID, FAKE_SECRET = "AKIAFAKE7Q2WZ", "fake-secret-9c1e4b7d"  # the Dagster host's; moto accepts any


@pytest.mark.e2e
def test_slurm_with_an_s3_store_a_cache_per_node_and_no_credentials_sent(
    slurm_cluster, home_copy, pretrain_reference, moto_s3, tmp_path, monkeypatch
):
    """The store is a bucket and nothing else is shared: the job's store cache is not the Dagster
    process's, the node reads its own credentials file (send_credentials: false), its output reaches the
    Dagster log through the store. Rank 1, interrupted (SIGINT) after the first checkpoint, is preempted:
    the reason reaches the Dagster log and the job is launched again on Slurm, ending exactly where the
    local run ends; materializing again is a cache hit. The Dagster host's
    secret is in no job script, no job environment Slurm keeps, no output, no object, no log."""
    store_uri = "s3://slurm-store/team/store"
    dagster_cache, job_cache = tmp_path / "dagster-cache", tmp_path / "job-cache"
    for var, value in s3_env(moto_s3, tmp_path).items():
        monkeypatch.setenv(var, value)
    monkeypatch.setenv("GHOSTVIS_STORE_CACHE", str(tmp_path / "test-cache"))
    keep_pretrain_checkpoints_only(home_copy / "store")
    upload(moto_s3, "slurm-store", "team/store", home_copy / "store")
    shutil.rmtree(home_copy / "store")  # nothing can come from a folder any more
    creds = tmp_path / "node-credentials"
    creds.write_text("[default]\naws_access_key_id = test\naws_secret_access_key = test\n")
    env = {
        **s3_env(moto_s3, tmp_path),
        "AWS_ACCESS_KEY_ID": FAKE_KEY_ID,
        "AWS_SECRET_ACCESS_KEY": FAKE_SECRET,
        "GHOSTVIS_STORE": store_uri,
        "GHOSTVIS_STORE_CACHE": str(dagster_cache),
    }
    launcher = {
        **slurm_launcher(
            output=str(tmp_path / "node-%j.out"),
            setup=[
                f"source {BIN / 'activate'}",
                f"export GHOSTVIS_STORE_CACHE={job_cache}",
                f"export AWS_SHARED_CREDENTIALS_FILE={creds}",
            ],
        ),
        "send_credentials": False,
    }
    store = open_store(store_uri)
    known = set(store.keys("checkpoint_marker", "pretrain"))
    log_path = tmp_path / "materialize.log"
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(
            [str(BIN / "dagster"), *materialize_pretrain(**launcher)[1:]],
            env=cli_env(home_copy, **env),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            cwd=Path(__file__).resolve().parent.parent,
        )
    run_key = wait_for_marker(store, known, proc, log_path)
    interrupt_rank(1, store_uri)  # SIGINT is a stop signal: the ranks commit, the stage launches the job again
    assert proc.wait(timeout=MATERIALIZE_TIMEOUT) == 0, log_path.read_text()[-4000:]
    log = log_path.read_text()
    assert re.search(
        rf"pretrain: launch 1 of run {run_key} was rank \d on {re.escape(socket.gethostname())} at \S+: "
        r"preempted at step \d+ \((SIGINT|a signal to another rank)\)",
        log,
    ), log[-4000:]
    script = slurm_scripts(store, run_key)[0]  # the preempted job's (the one launched again follows it)
    shipped = shipped_output(store, run_key, script)
    assert next(line for line in shipped.splitlines() if "tokens_per_step=" in line) in log  # reached the Dagster log
    # the ranks wrote the checkpoint in the job's cache and published it (the Dagster process fetches the run's
    # checkpoints only for its replay_matches check, which replays on the Dagster host)
    assert (job_cache / "slurm-store" / "team/store" / "checkpoints" / "pretrain" / run_key).is_dir()

    proc = run_cli(materialize_pretrain(**launcher), home_copy, timeout=MATERIALIZE_TIMEOUT, **env)
    ref_home, ref_dir = pretrain_reference
    assert run_key == ref_dir.name
    done, ref = run_result(store, "pretrain", run_key), run_result(Home(ref_home).store, "pretrain", run_key)
    assert (done.counts, done.train_loss, done.val_loss) == (ref.counts, ref.train_loss, ref.val_loss)
    last = ckpt.latest_complete(ref_dir).path
    assert (store.fetch("checkpoint", "pretrain", run_key, last.name) / "model.safetensors").read_bytes() == (
        last / "model.safetensors"
    ).read_bytes()

    kept = [f for f in (slurm_cluster.root / "state").rglob("*") if f.is_file()]  # what slurmctld keeps of jobs
    assert any(f.name == "environment" and b"GHOSTVIS_STORE_CACHE=" in f.read_bytes() for f in kept)
    places = [*kept, *tmp_path.glob("node-*.out"), *(p for p in (home_copy / "dagster").rglob("*") if p.is_file())]
    leaks = [str(p) for p in places if FAKE_SECRET.encode() in p.read_bytes() or FAKE_KEY_ID.encode() in p.read_bytes()]
    bucket = boto3.client("s3", endpoint_url=moto_s3)
    for page in bucket.get_paginator("list_objects_v2").paginate(Bucket="slurm-store", Prefix="team/store/runs/"):
        leaks += [
            o["Key"]
            for o in page.get("Contents", [])
            if FAKE_SECRET.encode() in bucket.get_object(Bucket="slurm-store", Key=o["Key"])["Body"].read()
        ]
    assert leaks == [] and FAKE_SECRET not in log + proc.stdout + proc.stderr


def while_materializing(what: str, found: Callable[[], T], proc: subprocess.Popen, log: Path) -> T:
    """found()'s first true value while the materialization `proc` runs (faults.wait_for); the
    materialization is killed when it never comes, so no job outlives the test."""
    try:
        return wait_for(what, found, proc, log, timeout=MATERIALIZE_TIMEOUT)
    except AssertionError:
        proc.kill()
        raise


def wait_for_marker(store, known: set, proc: subprocess.Popen, log: Path) -> str:
    """The run key of the first checkpoint committed in the store after `known` (its marker)."""

    def new_marker() -> str | None:
        new = set(store.keys("checkpoint_marker", "pretrain")) - known
        return sorted(new)[0][1] if new else None

    return while_materializing("a checkpoint", new_marker, proc, log)


def interrupt_rank(rank: int, store_uri: str) -> None:
    """SIGINT to the training process of global rank `rank` of the run in `store_uri` (a stop signal: it commits)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if (
                "ghostvis_core.run" in (p.info["cmdline"] or [])
                and any(store_uri in a for a in p.info["cmdline"])
                and p.environ().get("RANK") == str(rank)
            ):
                found.append(p)
        except psutil.Error:
            continue
    assert len(found) == 1, f"rank {rank}: found {found}"
    found[0].send_signal(signal.SIGINT)


def wait_for_checkpoint(home: Path, known: set[str], step: int, proc: subprocess.Popen, log: Path) -> Path:
    """The new run's folder once checkpoint `step` is committed in it."""

    def committed() -> Path | None:
        new = new_run_dirs(home, known)
        return new[-1] if new and any(c.step >= step for c in ckpt.list_complete(new[-1])) else None

    return while_materializing(f"checkpoint {step}", committed, proc, log)


def array_tasks_by_job(job_dir: Path) -> list[int]:
    """How many task logs (<job id>_<array index>.out) each job of a datatrove Slurm run wrote, sorted."""
    return sorted(Counter(log.name.split("_")[0] for log in job_dir.glob("slurm_logs/*.out")).values())


@pytest.mark.e2e
def test_tokenization_runs_as_a_slurm_job_array_and_gives_the_same_ledger(slurm_cluster, home_copy):
    """With the slurm launcher, tokenized_shards runs its datatrove pipeline through datatrove's
    SlurmPipelineExecutor (one array task per shard) on the cluster's nodes; the ledger rows equal
    the ones the local workers wrote."""
    store = Home(home_copy).store
    shards = ["demo_prose/00000", "demo_prose/00001"]
    before = {r.shard_id: r for r in Ledger.in_store(store).shards() if r.shard_id in shards}
    for f in store.fetch("ledger_file", "shards").glob("*.parquet"):  # forget them: they must be redone
        if set(pq_shard_ids(f)) & set(shards):
            f.unlink()
    config = {"resources": {"launcher": {"config": slurm_launcher()}}}
    run_cli(
        materialize("tokenized_shards", "--partition-range", "...".join(shards), config=config),
        home_copy,
        timeout=MATERIALIZE_TIMEOUT,
    )
    after = {r.shard_id: r for r in Ledger.in_store(store).shards() if r.shard_id in shards}
    for shard in shards:
        assert {k: getattr(after[shard], k) for k in ("docs", "tokens", "text_bytes", "content_sha256", "split")} == {
            k: getattr(before[shard], k) for k in ("docs", "tokens", "text_bytes", "content_sha256", "split")
        }
    [job_dir] = (home_copy / "logs" / "datatrove").glob("*/slurm-*")
    # the array (one task per shard), and datatrove's stats merge: a job of its own that Slurm starts once
    # the array is done, so it may still be pending when the materialization (which waits for the array) ends
    deadline = time.time() + 120
    while (tasks := array_tasks_by_job(job_dir)) != [1, len(shards)] and time.time() < deadline:
        time.sleep(0.5)
    assert tasks == [1, len(shards)]
    assert "launch_pickled_pipeline" in (job_dir / "launch_script.slurm").read_text()


def pq_shard_ids(path: Path) -> list[str]:
    import pyarrow.parquet as pq

    return pq.read_table(path, columns=["shard_id"]).column("shard_id").to_pylist()

"""What every launcher tells when a run fails, and how the files it needs reach nodes that share
nothing with the Dagster host but the store: each failing rank's reason (first in time first), the
job output shipper, and `ghostvis store cat`. Real stores (a folder), real processes."""

from __future__ import annotations

import subprocess
import sys

from ghostvis_core.home import Home
from ghostvis_core.run.ship_output import chunk_name
from ghostvis_core.runs.reasons import clear_reasons, input_problem, rank_reasons, record_reason, run_reason
from ghostvis_core.store import open_store
from ghostvis_pipeline.launchers.common import failure, host_environment
from tests.conftest import BIN
from tests.launch_records import launch_record

STAGE, RUN = "pretrain", "pretrain-abc-r1"


def test_the_run_reason_is_the_first_failure_in_time_then_the_others(tmp_path):
    store = open_store(str(tmp_path / "store"))
    store.write_json(
        "run_error",
        STAGE,
        RUN,
        "1",
        data={
            "rank": 1,
            "host": "gv2",
            "time": "2026-11-26T10:00:05.000001+00:00",
            "reason": "Connection closed by peer",
        },
    )
    store.write_json(
        "run_error",
        STAGE,
        RUN,
        "0",
        data={
            "rank": 0,
            "host": "gv1",
            "time": "2026-11-26T10:00:04.900000+00:00",
            "reason": "No space left on device",
        },
    )
    assert run_reason(store, STAGE, RUN) == (
        "rank 0 on gv1 at 2026-11-26T10:00:04.900000+00:00: No space left on device\n"
        "then rank 1 on gv2 at 2026-11-26T10:00:05.000001+00:00: Connection closed by peer"
    )


def test_a_rank_keeps_its_first_reason_and_a_new_attempt_starts_with_none(tmp_path):
    store = open_store(str(tmp_path / "store"))
    record_reason(store, STAGE, RUN, 1, "RuntimeError: the root cause")
    record_reason(store, STAGE, RUN, 1, "RuntimeError: what followed")
    [record] = [store.read_json("run_error", *key) for key in store.keys("run_error", STAGE, RUN)]
    assert (record["rank"], record["reason"]) == (1, "RuntimeError: the root cause")
    assert record["host"] and record["time"].endswith("+00:00")
    clear_reasons(store, STAGE, RUN)
    assert store.keys("run_error", STAGE, RUN) == [] and run_reason(store, STAGE, RUN) is None


def test_the_launcher_failure_names_the_ranks_reason_and_its_own(tmp_path, monkeypatch):
    monkeypatch.delenv("GHOSTVIS_STORE", raising=False)
    home = Home(tmp_path)
    spec = launch_record(STAGE, RUN, {}, {}, store=home.store.uri)
    assert (
        failure(home, spec, "Slurm job 7 ended FAILED").description
        == f"{STAGE} run {RUN} failed: Slurm job 7 ended FAILED"
    )
    record_reason(home.store, STAGE, RUN, 1, "KeyboardInterrupt: ")
    told = failure(home, spec, "Slurm job 7 ended FAILED").description
    assert told.startswith(f"{STAGE} run {RUN} failed: rank 1 on ") and told.endswith(
        ": KeyboardInterrupt: \n(Slurm job 7 ended FAILED)"
    )


def test_the_job_output_is_shipped_in_numbered_chunks_and_passed_on(tmp_path):
    store_dir = tmp_path / "store"
    lines = "".join(f"line {i}\n" for i in range(3))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ghostvis_core.run.ship_output",
            "--store",
            str(store_dir),
            "--stage",
            STAGE,
            "--run-key",
            RUN,
            "--name",
            "slurm/a1/out",
        ],
        input=lines,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and proc.stdout == lines  # the node-local --output file gets it too
    store = open_store(str(store_dir))
    assert store.read_text("run_file", STAGE, RUN, chunk_name("slurm/a1/out", 1)) == lines
    assert not store.exists("run_file", STAGE, RUN, chunk_name("slurm/a1/out", 2))


def test_store_cat_prints_a_run_file_by_the_uri_a_launcher_logged(tmp_path):
    store = open_store(str(tmp_path / "store"))
    uri = store.write_text("run_file", STAGE, RUN, "torchrun/nodes.sh", text="#!/bin/sh\necho node\n")
    proc = subprocess.run([str(BIN / "ghostvis"), "store", "cat", uri], capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout) == (0, "#!/bin/sh\necho node\n")
    bad = subprocess.run(
        [str(BIN / "ghostvis"), "store", "cat", str(tmp_path / "nodes.sh")], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and "expected a run's file, <store>/runs/<stage>/<run_key>/<name>" in bad.stderr


def test_without_credentials_no_secret_is_passed_on_to_sbatch_or_a_node_shell(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "fake-secret")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAFAKE")
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "fake-token")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9000")
    kept = host_environment(False)
    assert not {"AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "MLFLOW_TRACKING_TOKEN"} & set(kept)
    assert kept["AWS_ENDPOINT_URL_S3"] == "http://127.0.0.1:9000"
    assert host_environment(True)["AWS_SECRET_ACCESS_KEY"] == "fake-secret"


def test_a_problem_of_the_inputs_is_told_apart_from_the_faults_that_followed_it(tmp_path):
    """Rank 1 met a token block that does not match its digest (recorded as no fault); rank 0 was stopped by
    torchrun afterwards (a fault of its own kind). The run's input problem is rank 1's, whatever came first in
    time; a run whose ranks recorded only faults has none (its stage's retry resumes it)."""
    store = open_store(str(tmp_path / "store"))
    record_reason(store, STAGE, RUN, 0, "RuntimeError: Connection closed by peer")
    assert input_problem(store, STAGE, RUN) is None
    said = "token shard web/00003: block 1 of file web.arrow does not match the digest written at tokenization"
    record_reason(store, STAGE, RUN, 1, said, fault=False)
    host = store.read_json("run_error", STAGE, RUN, "1")["host"]
    assert input_problem(store, STAGE, RUN) == f"rank 1 on {host}: {said}"
    assert [r["fault"] for r in rank_reasons(store, STAGE, RUN)] == [True, False]
    clear_reasons(store, STAGE, RUN)
    assert input_problem(store, STAGE, RUN) is None

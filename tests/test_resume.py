"""Crash, resume, re-run (end to end through the dagster CLI and torchrun).

The short pretraining run (tests/conftest.py: smoke preset, 12 steps, a checkpoint every 4) is killed
with SIGKILL after a checkpoint and re-materialized; the result is compared with the uninterrupted run
of the same config in a copy of the same state (the `pretrain_reference` fixture)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.ledger.records import PartRow
from ghostvis_core.errors import GhostvisError
from ghostvis_core.home import Home
from ghostvis_core.plan.budget import batch_plan
from ghostvis_core.plan.presets import resolve
from ghostvis_core.run.train import checkpoint as ckpt
from ghostvis_core.runs.launch_spec import launch_records
from ghostvis_core.runs.lookup import run_result
from ghostvis_core.store.layout import step_dir_name
from tests.conftest import (
    BIN,
    SHORT_PRETRAIN,
    cli_env,
    copy_home,
    materialize_pretrain,
    new_run_dirs,
    run_cli,
    run_names,
)

SHORT_PRETRAIN_TOKENS_PER_STEP = batch_plan(resolve("pretrain", "smoke", SHORT_PRETRAIN).batch).tokens_per_step

pytestmark = pytest.mark.e2e

MATERIALIZE = materialize_pretrain()


def newest_run_dir(home: Path, known: set[str]) -> Path | None:
    new = new_run_dirs(home, known)
    return new[-1] if new else None


def part_in_ledger(home: Path, checkpoint: Path) -> bool:
    """Whether the checkpoint's ledger part has been copied into the store's ledger, the commit's last
    step (killed before it, the part lives only inside the checkpoint until a resume republishes it)."""
    store = Home(home).store
    files = [f.relative_to(checkpoint / "ledger").as_posix() for f in (checkpoint / "ledger").rglob("*.parquet")]
    return bool(files) and all(store.exists("ledger_file", f) for f in files)


def start_and_kill_after(home: Path, step: int) -> Path:
    """Start the materialization, SIGKILL the whole process group once checkpoint `step` is
    committed, its ledger part included (the run is then between checkpoints), and return the run's
    checkpoint folder."""
    known = run_names(home)
    proc = subprocess.Popen(
        [str(BIN / MATERIALIZE[0]), *MATERIALIZE[1:]],
        env=cli_env(home),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    deadline = time.time() + 300
    run_dir = None
    while time.time() < deadline:
        run_dir = run_dir or newest_run_dir(home, known)
        if run_dir and any(c.step >= step and part_in_ledger(home, c.path) for c in ckpt.list_complete(run_dir)):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return run_dir
        if proc.poll() is not None:
            raise AssertionError(f"materialization ended (exit {proc.returncode}) before checkpoint {step}")
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError(f"no checkpoint {step} within 300 s")


def latest_check(home: Path, asset: str, check: str):
    """The newest evaluation of an asset check, from the Dagster instance in `home`."""
    from dagster import AssetCheckKey, AssetKey, DagsterInstance

    os.environ["DAGSTER_HOME"] = str(home / "dagster")
    records = DagsterInstance.get().event_log_storage.get_asset_check_execution_history(
        AssetCheckKey(AssetKey(asset), check), limit=1
    )
    return records[0].event.dagster_event.event_specific_data


def consumed(ledger: Ledger, parts: list[PartRow]) -> list[tuple[str, int, int, int]]:
    return sorted((r.shard_id, r.epoch, r.tok_start, r.tok_end) for r in ledger.consumption(parts))


def covered(ranges) -> set[tuple[str, int, int]]:
    return {(s, e, t) for s, e, a, b in ranges for t in range(a, b)}


@pytest.fixture(scope="module")
def killed(demo_home, module_tmp) -> tuple[Path, Path]:
    """(home, run folder): a copy of the demo home whose short pretraining run was SIGKILLed once checkpoint 8
    was committed. The older-checkpoint test resumes copies of it; the sigkill test, after it in this file,
    resumes it in place (a resume from another folder writes a resume launch record, which it checks is not
    written)."""
    home = copy_home(demo_home, module_tmp("killed") / "home")
    return home, start_and_kill_after(home, 8)


def killed_copy(killed: tuple[Path, Path], dest: Path) -> tuple[Path, Path]:
    home, run_dir = killed
    copy = copy_home(home, dest)
    return copy, copy / run_dir.relative_to(home)


def test_resuming_from_an_older_checkpoint_is_flagged_as_reuse_unless_the_newer_one_is_damaged(killed, tmp_path):
    """Killed after checkpoint 8, the run is resumed from checkpoint 4 in two copies of that state. Checkpoint 8
    deleted: steps 5..8 are read twice and nothing says why, so no_reuse fails. Checkpoint 8 damaged (a byte
    of its weights flipped): the resume passes over it, naming it, and its parts declare steps 5..8
    retrained_after_fallback with the checkpoint and the reason; every check passes."""
    home_copy, run_dir = killed_copy(killed, tmp_path / "home")
    assert [c.step for c in ckpt.list_complete(run_dir)][-2:] == [4, 8]
    damaged_home = copy_home(home_copy, tmp_path / "damaged")  # one launch for both cases
    shutil.rmtree(run_dir / step_dir_name(8))  # its ledger part stays: steps 5..8 were trained
    proc = run_cli(MATERIALIZE, home_copy, check=False)
    assert proc.returncode != 0  # the blocking no_reuse check fails the run
    reuse = [r for r in Ledger.in_store(Home(home_copy).store).reuse(run_dir.name) if r.kind == "reuse"]
    assert reuse and all(r.run_a == r.run_b == run_dir.name for r in reuse)
    # the twice-read range is exactly what segment 0 read in steps 5..8
    assert sum(r.tokens for r in reuse) == 4 * SHORT_PRETRAIN_TOKENS_PER_STEP
    evaluation = latest_check(home_copy, "pretrain", "no_reuse")
    assert evaluation.passed is False
    md = {k: v.value for k, v in evaluation.metadata.items()}
    assert md["reused_tokens"] == 4 * SHORT_PRETRAIN_TOKENS_PER_STEP
    first = reuse[0]
    assert f"{first.tok_start}..{first.tok_end}" in md["ranges"] and first.shard_id in md["ranges"]

    weights = damaged_home / run_dir.relative_to(home_copy) / step_dir_name(8) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF
    weights.unlink()  # a new file: the copies share the committed step's files (hard links)
    weights.write_bytes(bytes(data))
    proc = run_cli(MATERIALIZE, damaged_home)  # every blocking check passes
    assert f"[pretrain] not resuming from it: checkpoint {weights.parent}: model.safetensors has sha256 " in (
        proc.stdout + proc.stderr
    )
    ledger = Ledger.in_store(Home(damaged_home).store)
    found = ledger.reuse(run_dir.name)
    assert {r.kind for r in found} == {"retrained_after_fallback"}
    assert sum(r.tokens for r in found) == 4 * SHORT_PRETRAIN_TOKENS_PER_STEP  # steps 5..8, trained again
    assert {r.checkpoint for r in found} == {step_dir_name(8)}
    assert all(r.reason.startswith("model.safetensors has sha256 ") for r in found)
    assert {(r.steps_a, r.steps_b) for r in found} == {("5..8", "5..8")}
    chain = ledger.chain(run_dir.name)
    assert [(p.segment, p.step_last) for p in chain] == [(0, 4), (1, 8), (1, 12)]
    md = {k: v.value for k, v in latest_check(damaged_home, "pretrain", "no_reuse").metadata.items()}
    assert md["reused_tokens"] == 0 and md["retrained_after_fallback_tokens"] == 4 * SHORT_PRETRAIN_TOKENS_PER_STEP
    assert md["passed_over_checkpoints"] == step_dir_name(8)
    done = run_result(Home(damaged_home).store, "pretrain", run_dir.name)
    assert done.counts == ledger.run_counts(run_dir.name) and done.steps == 12


def test_sigkill_between_checkpoints_then_rematerialize_resumes_exactly(killed, pretrain_reference):
    """Killed after a checkpoint, with the half-written next checkpoint a kill during save leaves: the
    re-materialization ignores the cut save and resumes from the last committed one, exactly."""
    ref_home, ref_dir = pretrain_reference
    home_copy, run_dir = killed
    assert not (run_dir / "RUN_COMPLETE.json").exists()  # the run_record artifact
    killed_at = ckpt.latest_complete(run_dir).step
    assert 8 <= killed_at < 12
    partial = run_dir / f".tmp-{step_dir_name(killed_at + 4)}-killed"
    partial.mkdir()
    good = (run_dir / step_dir_name(killed_at) / "model.safetensors").read_bytes()
    (partial / "model.safetensors").write_bytes(good[: len(good) // 3])
    spec_file = Path(Home(home_copy).store.uri_of("run_spec", "pretrain", run_dir.name))
    launched = (spec_file.read_bytes(), spec_file.stat().st_mtime_ns)
    run_cli(MATERIALIZE, home_copy)  # re-materialize: the unfinished run is found and resumed
    assert not partial.exists()
    # resumed as it was launched: its launch record is not written again, nor another beside it
    assert (spec_file.read_bytes(), spec_file.stat().st_mtime_ns) == launched
    assert launch_records(Home(home_copy).store, "pretrain", run_dir.name) == [("run_spec", "pretrain", run_dir.name)]

    assert run_dir.name == ref_dir.name  # same config and data -> same run key
    done = run_result(Home(home_copy).store, "pretrain", run_dir.name)
    ref = run_result(Home(ref_home).store, "pretrain", ref_dir.name)
    ledger, ref_ledger = Ledger.in_store(Home(home_copy).store), Ledger.in_store(Home(ref_home).store)
    chain = ledger.chain(run_dir.name)
    segments = sorted({p.segment for p in chain})
    assert segments == [0, 1] and done.segment == 1
    assert min(p.step_first for p in chain if p.segment == 1) == killed_at + 1
    seg0 = [p for p in chain if p.segment == 0]
    seg1 = [p for p in chain if p.segment == 1]
    a, b = covered(consumed(ledger, seg0)), covered(consumed(ledger, seg1))
    whole = covered(consumed(ref_ledger, ref_ledger.chain(ref_dir.name)))
    assert a and b and not (a & b)  # no token (so no shard row) read twice across the resume
    assert a | b == whole  # and none skipped: the union is exactly the uninterrupted run's
    assert done.counts == ref.counts == ledger.run_counts(run_dir.name)
    assert done.steps == ref.steps == ledger.run_totals(run_dir.name).steps
    # CPU training is deterministic here (fixed threads, gloo sum of 2 ranks): the resumed run ends
    # bitwise where the uninterrupted one does
    assert done.train_loss == ref.train_loss and done.val_loss == ref.val_loss
    final = ckpt.latest_complete(run_dir).path / "model.safetensors"
    assert final.read_bytes() == (ckpt.latest_complete(ref_dir).path / "model.safetensors").read_bytes()
    # the MLflow run continued instead of starting a second one
    first = ckpt.read_state(run_dir / step_dir_name(12))
    assert done.mlflow_run_id == first["mlflow_run_id"]
    from mlflow.tracking import MlflowClient

    history = MlflowClient(Home(home_copy).mlflow_tracking_uri).get_metric_history(done.mlflow_run_id, "tokens/real")
    assert max(m.value for m in history) == done.counts.real_tokens


def test_a_resume_on_another_world_size_saves_its_launch_record_beside_the_first(home_copy):
    """The short run launched, then launched again before it finished (what a re-materialization after a crash
    does, here without training): on the same ranks nothing is written (spec.json's and the identity record's
    bytes and modification times as they were); on one rank (the same run: its identity leaves the rank split
    out) the resume's record is spec.2.json, the first launch's record and the identity stay as they were, and
    the job reads the newest."""
    from ghostvis_core.launch.start import prepare_run
    from ghostvis_core.runs.launch_spec import LaunchSpec

    home = Home(home_copy)
    first = prepare_run("pretrain", preset="smoke", home=home, overrides=SHORT_PRETRAIN)
    key = ("pretrain", first.run_key)
    files = [Path(home.store.uri_of("run_spec", *key)), Path(home.store.uri_of("identity", *key))]
    saved = [(f.read_bytes(), f.stat().st_mtime_ns) for f in files]
    assert prepare_run("pretrain", preset="smoke", home=home, overrides=SHORT_PRETRAIN) == first
    assert [(f.read_bytes(), f.stat().st_mtime_ns) for f in files] == saved
    assert launch_records(home.store, *key) == [("run_spec", *key)]
    one_rank = SHORT_PRETRAIN | {"batch.world_size": "1", "batch.grad_accum_steps": "2"}
    resumed = prepare_run("pretrain", preset="smoke", home=home, overrides=one_rank)
    assert resumed.run_key == first.run_key and (first.plan.batch.world_size, resumed.plan.batch.world_size) == (2, 1)
    assert [(f.read_bytes(), f.stat().st_mtime_ns) for f in files] == saved
    assert launch_records(home.store, *key) == [("run_spec", *key), ("run_spec_resume", *key, "2")]
    assert LaunchSpec.read(home.store, *key) == resumed and LaunchSpec.from_dict(json.loads(saved[0][0])) == first
    edited = json.loads(saved[1][0])
    edited["identity"]["tokenizer"] = "another"
    home.store.write_json("identity", *key, data=edited)
    with pytest.raises(GhostvisError, match=rf"run {first.run_key}: this launch trains another tokenizer than the run"):
        prepare_run("pretrain", preset="smoke", home=home, overrides=SHORT_PRETRAIN)

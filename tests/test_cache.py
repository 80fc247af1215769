"""Cached stages (docs/architecture.md, "Identity and caching"), end to end on copies of the demo home:
a second demo trains nothing; the same bytes downloaded again change nothing; a moved store keeps
its cache hits; a changed sft override retrains sft and makes only dpo (and the eval assets) stale; a
new tokenizer vocabulary makes every stage stale. force: true: test_e2e_demo.py
(test_rematerializing_one_stage_through_the_dagster_cli)."""

from __future__ import annotations

import json
import re
import shutil
import sqlite3
from pathlib import Path

import pytest

from ghostvis_core.home import Home
from ghostvis_core.plan import presets
from ghostvis_core.plan.stages import stage_names
from ghostvis_core.store import open_store
from tests.conftest import run_cli

pytestmark = pytest.mark.e2e

STAGES = stage_names()
DATA = ["shard_manifest", "raw_shards", "tokenizer", "tokenized_shards", "token_ledger"]


def mlflow_run_ids(home: Path) -> set[str]:
    with sqlite3.connect(home / "mlflow.db") as db:
        return {r[0] for r in db.execute("select run_uuid from runs")}


def run_folders(store_root: Path) -> set[tuple[str, ...]]:
    return set(open_store(str(store_root)).keys("checkpoints"))


def status(home: Path, **env: str) -> dict[str, dict]:
    out = run_cli(["ghostvis", "status", "--json"], home, **env).stdout
    return {row["asset"]: row for row in json.loads(out)}


def inputs_unchanged(row: dict) -> bool:
    """Up to date, or stale only because code changed since (other work in the tree while the suite runs)."""
    return all(r.startswith("its code changed") or ": its code changed" in r for r in row["reasons"])


def train(home: Path, *args: str, **env: str) -> tuple[str, bool]:
    """`ghostvis train ...`: (the run key it materialized, whether it was a cache hit)."""
    out = run_cli(["ghostvis", "train", *args], home, **env).stdout
    return re.search(rf"^{args[0]}: run (\S+),", out, re.M).group(1), "\ncached: " in out


def materialize(home: Path, select: str, *extra: str, **env: str) -> None:
    run_cli(
        ["dagster", "asset", "materialize", "--select", select, "-m", "ghostvis_pipeline.definitions", *extra],
        home,
        **env,
    )


def test_a_second_demo_trains_nothing_and_the_same_bytes_again_change_nothing(home_copy):
    runs, folders = mlflow_run_ids(home_copy), run_folders(home_copy / "store")
    out = run_cli(["ghostvis", "demo", "--preset", "smoke"], home_copy, timeout=1200).stdout
    rows = {line.split()[0]: line for line in out.splitlines() if line.split()}
    for asset in ["tokenizer", *STAGES, "evaluation", "report"]:
        assert rows[asset].endswith("cached"), f"{asset} was not a cache hit:\n{out}"
    passed, total = map(int, rows["checks:"].split()[1].split("/"))
    assert passed == total > 0, rows["checks:"]
    assert mlflow_run_ids(home_copy) == runs, "the second demo started MLflow runs"
    assert run_folders(home_copy / "store") == folders, "the second demo wrote new run folders"

    store = Home(home_copy).store
    shard = sorted(k for (k,) in store.keys("raw_shard"))[0]
    store.delete("raw_shard", shard)  # downloaded again: the same bytes
    materialize(home_copy, "raw_shards", "--partition", shard)
    st = status(home_copy)
    for asset in [*DATA, *STAGES, "evaluation", "report"]:
        assert inputs_unchanged(st[asset]), st[asset]


def test_a_moved_store_a_changed_override_and_a_new_tokenizer(home_copy, tmp_path):
    moved = tmp_path / "elsewhere" / "store"
    moved.parent.mkdir()
    shutil.move(str(home_copy / "store"), str(moved))
    env = {"GHOSTVIS_STORE": str(moved)}
    runs = mlflow_run_ids(home_copy)
    _, cached = train(home_copy, "dpo", **env)
    assert cached and mlflow_run_ids(home_copy) == runs, "the moved store lost dpo's cache hit"

    _, cached = train(home_copy, "sft", "--set", "budget.steps=2", **env)
    assert not cached
    st = status(home_copy, **env)
    assert st["dpo"]["state"] == "stale" and any("input sft changed" in r for r in st["dpo"]["reasons"]), st["dpo"]
    for stage in STAGES[: STAGES.index("sft") + 1]:
        assert inputs_unchanged(st[stage]), st[stage]
    assert st["evaluation"]["state"] == "stale", st["evaluation"]

    vocab = presets.tokenizer_vocab("smoke") + 64
    materialize(
        home_copy,
        "tokenizer",
        "--config-json",
        json.dumps({"ops": {"tokenizer": {"config": {"preset": "smoke", "vocab_size": vocab}}}}),
        **env,
    )
    st = status(home_copy, **env)
    for asset in ["tokenized_shards", "token_ledger", *STAGES, "evaluation"]:
        assert st[asset]["state"] == "stale" and any("tokenizer changed" in r for r in st[asset]["reasons"]), st[asset]
    shard = sorted(k for (k,) in open_store(str(moved)).keys("raw_shard"))[0]
    materialize(home_copy, "tokenized_shards", "--partition", shard, **env)  # tokenized again, with the new tokenizer
    after = status(home_copy, **env)["tokenized_shards"]
    assert after["partitions"].startswith("1/"), after


def test_two_launches_of_one_run_identity_train_once_and_the_second_is_a_cache_hit_naming_the_first(home_copy):
    """Two people press Materialize at the same moment: the first launch holds the run identity's lease and
    trains; `--no-wait` is refused naming it; the waiting launch returns the first one's run as a cache hit. The
    ledger holds exactly what was trained, and one MLflow run was made."""
    import subprocess
    import time

    from ghostvis_core.data.ledger import Ledger
    from ghostvis_core.runs.lookup import run_result
    from tests.conftest import BIN, cli_env

    runs = mlflow_run_ids(home_copy)
    store = Home(home_copy).store
    leases = set(store.keys("lease", "sft"))  # the demo's own sft run's
    argv = [str(BIN / "ghostvis"), "train", "sft", "--set", "budget.steps=3"]
    cwd = Path(__file__).resolve().parent.parent
    first = subprocess.Popen(argv, env=cli_env(home_copy), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    time.sleep(0.5)
    second = subprocess.Popen(argv, env=cli_env(home_copy), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not set(store.keys("lease", "sft")) - leases and time.monotonic() < deadline:  # one launch holds it
        time.sleep(0.2)
    refused = run_cli([*argv, "--no-wait"], home_copy, check=False)
    outs = [p.communicate(timeout=600)[0].decode() for p in (first, second)]
    assert first.returncode == 0 and second.returncode == 0, "\n".join(o[-3000:] for o in outs)

    keys = [re.search(r"^sft: run (\S+),", o, re.M).group(1) for o in outs]
    assert keys[0] == keys[1], keys
    trained = [o for o in outs if "\ncached: " not in o]
    assert len(trained) == 1, "both launches trained (or neither did):\n" + "\n".join(o[-2000:] for o in outs)
    hit = next(o for o in outs if "\ncached: " in o)
    assert keys[0] in hit.split("\ncached: ")[1].splitlines()[0], hit[-1500:]
    assert refused.returncode != 0 and "held by Dagster run" in refused.stdout + refused.stderr, refused.stdout[-2000:]
    assert len(mlflow_run_ids(home_copy) - runs) == 1, "two MLflow runs for one run identity"

    result = run_result(store, "sft", keys[0])
    chain = Ledger.in_store(store).chain(keys[0])
    assert sum(p.real_tokens for p in chain) == result.counts.real_tokens > 0
    assert chain[-1].step_last == result.steps == 3

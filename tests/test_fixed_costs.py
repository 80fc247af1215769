"""Fixed costs of a stage launch (issue 26): what a rank imports before its first optimizer step.
The timings are benchmarks/fixed_costs.py's; these tests keep the libraries that are needed only later
(or never, on a run's path to step 1) from coming back onto that path."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pyarrow as pa

from ghostvis_core.data.token_shard import list_column, numpy_view, write_token_shard
from ghostvis_core.home import Home
from ghostvis_core.plan.stages import stage_names
from ghostvis_core.runs.lookup import completed_runs

# Needed only after training (the HF export and model registration), only on the MLflow logging thread,
# only with an S3 store, only by pyarrow's pandas conversion, or only at the ledger's first query (rank 0
# preparing a run): none of it on a rank's way to step 1.
LATER = ("mlflow", "transformers", "huggingface_hub", "pandas", "boto3", "scipy", "datatrove", "duckdb")

IMPORT_AND_READ = """
import sys
from pathlib import Path
import ghostvis_core.run.__main__
from ghostvis_core.data.token_shard import TokenShard
shard = TokenShard.open(Path(sys.argv[1]))
print(shard.num_docs, shard.doc_tokens(1).tolist(), shard.doc_list("mask", 1).tolist())
print(" ".join(sorted(name for name in sys.argv[2:] if name in sys.modules)))
"""


def test_the_entry_point_and_a_token_shard_read_import_nothing_needed_later(tmp_path):
    path = tmp_path / "00000.arrow"
    write_token_shard(
        path,
        {
            "row": pa.array([0, 1, 2]),
            "tokens": list_column([2, 3, 0], [5, 6, 7, 8, 9], np.uint16),
            "mask": list_column([2, 3, 0], [0, 1, 0, 1, 1], np.uint8),
        },
    )
    out = subprocess.run(
        [sys.executable, "-c", IMPORT_AND_READ, str(path), *LATER], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out[0] == "3 [7, 8, 9] [0, 1, 1]"
    assert out[1] == "", f"imported before the first step although needed only later: {out[1]}"


# What the Dagster process never needs to load the definitions: the trainer and the model (torch), the
# evaluation's harness (lm_eval, datasets), MLflow's model logging, the ledger's query engine and S3.
NOT_IN_DAGSTER = ("torch", "lm_eval", "datasets", "transformers", "mlflow", "duckdb", "boto3")


def loaded_by_importing(module: str, names: tuple[str, ...]) -> str:
    """Which of `names` a fresh interpreter has loaded once it imported `module`, space-separated."""
    code = f"import sys, {module}; print(' '.join(n for n in sys.argv[1:] if n in sys.modules))"
    return subprocess.run(
        [sys.executable, "-c", code, *names], capture_output=True, text=True, check=True
    ).stdout.strip()


def test_loading_the_dagster_definitions_imports_no_trainer_model_or_harness():
    out = loaded_by_importing("ghostvis_pipeline.definitions", NOT_IN_DAGSTER)
    assert out == "", f"imported by every process that loads the Dagster definitions: {out}"


KEPT_STEPS = """
import sys
from types import SimpleNamespace
from ghostvis_core.store import open_store
from ghostvis_core.verify.replay.intervals import kept_steps
chain = [SimpleNamespace(step_last=s) for s in (4, 8, 12)]
print(kept_steps(open_store(sys.argv[1]), "pretrain", "r1", chain))
print(" ".join(n for n in sys.argv[2:] if n in sys.modules))
"""


def test_the_replay_checks_kept_checkpoints_are_found_without_torch(tmp_path):
    """The replay check (in the Dagster process) finds the run's committed checkpoints by their folder names
    alone: steps 4 and 8 committed, 12 pruned."""
    for step in (4, 8):
        marker = tmp_path / "store" / "checkpoints" / "pretrain" / "r1" / f"step_{step:09d}" / "COMPLETE"
        marker.parent.mkdir(parents=True)
        marker.write_text("{}")
    (tmp_path / "store" / "checkpoints" / "pretrain" / "r1" / "step_000000012").mkdir()  # no marker: not committed
    argv = [sys.executable, "-c", KEPT_STEPS, str(tmp_path / "store"), *NOT_IN_DAGSTER]
    kept, loaded = subprocess.run(argv, capture_output=True, text=True, check=True).stdout.split("\n")[:2]
    assert kept == "[4, 8]"
    assert "torch" not in loaded.split(), f"the replay check's checkpoint lookup imported: {loaded}"


# What the `ghostvis` command loads only in the subcommands that use it (Dagster in status, train, demo and data;
# MLflow in audit): `ghostvis ledger`, `plan` or `--help` pay none of it (dagster alone is ~1.2 s of imports).
NOT_IN_THE_CLI = ("dagster", "torch", "mlflow", "transformers", "lm_eval")


def test_the_ghostvis_command_imports_dagster_torch_and_mlflow_only_in_the_subcommands_that_use_them():
    out = loaded_by_importing("ghostvis_pipeline.cli", NOT_IN_THE_CLI)
    assert out == "", f"imported by every `ghostvis` command: {out}"


def test_numpy_view_matches_pyarrow_for_slices_and_empty_arrays():
    values = pa.array(np.arange(10, dtype=np.int64))
    for array in (values, values.slice(3, 4), values.slice(10, 0), pa.array([], pa.uint16())):
        view = numpy_view(array)
        assert view.dtype == array.type.to_pandas_dtype() and view.tolist() == array.to_pylist()


def test_the_evaluation_before_the_first_step_reaches_mlflow_at_step_0(demo_home):
    """The MLflow run is created after the first optimizer step (run/train/live_metrics.py); the held-out
    evaluation logged before it waits in the tracker and reaches the run first, at step 0, in every stage
    that has a held-out loss (rl's held-out figures are its rewards)."""
    from mlflow.tracking import MlflowClient

    home = Home(demo_home)
    client = MlflowClient(home.mlflow_tracking_uri)
    checked = []
    for stage in stage_names():
        (run,) = completed_runs(home.store, stage)
        if run.val_loss_start is None:
            continue
        history = client.get_metric_history(run.mlflow_run_id, "val/loss")
        first = min(history, key=lambda m: (m.step, m.timestamp))
        assert (first.step, first.value) == (0, run.val_loss_start), (stage, first)
        checked.append(stage)
    assert checked == [s for s in stage_names() if s != "rl"]

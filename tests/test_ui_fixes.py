"""What the UIs' actions rest on, without a browser (tests/test_ui_actions.py clicks them): Launchpad
overrides typed as YAML scalars mean what `--set` means; metadata tables keep one row per row; a
re-trained stage leaves every asset above it unsynced, with the reasons `ghostvis status` gives; the
MLflow experiment is tagged as model training."""

from __future__ import annotations

import re

import pytest

from ghostvis_core.plan import presets
from ghostvis_core.plan.config import parse_sets
from ghostvis_core.plan.stages import stage_names
from ghostvis_pipeline.metadata import md_table

STAGES = stage_names()


# --------------------------------------------------------------------------------- metadata tables


def rendered_cells(markdown: str) -> list[list[str]]:
    """The table as a GFM renderer sees it (markdown-it's table rule, as Dagster's UI renders metadata)."""
    from markdown_it import MarkdownIt

    html = MarkdownIt("commonmark").enable("table").render(markdown)
    return [re.findall(r"<t[dh]>(.*?)</t[dh]>", row) for row in re.findall(r"<tr>(.*?)</tr>", html, re.S)]


def test_a_cell_with_pipes_and_line_breaks_stays_in_its_row():
    completion = "Answer: 7\n\n| x | y |\nthen more"  # what a sampled completion holds
    table = md_table(["stage", "'Q | A'"], [["pretrain", completion], ["sft", 1234567], ["dpo", ""]])
    assert rendered_cells(table) == [
        ["stage", "'Q | A'"],
        ["pretrain", "Answer: 7 | x | y | then more"],
        ["sft", "1,234,567"],
        ["dpo", ""],
    ]


# ----------------------------------------------------------------------------------- typed overrides


def test_launchpad_overrides_typed_as_yaml_scalars_resolve_like_set_flags():
    """`overrides: {budget.steps: 30, ...}` as a person types it in the Launchpad passes Dagster's
    config check with its types, and resolves to the same stage config as `--set budget.steps=30 ...`."""
    from dagster import validate_run_config

    from ghostvis_pipeline.definitions import defs

    typed = {"budget.steps": 30, "optim.lr": 0.002, "data.allow_repeat": True, "optim.name": "muon"}
    flags = ["budget.steps=30", "optim.lr=0.002", "data.allow_repeat=true", "optim.name=muon"]
    checked = validate_run_config(defs.resolve_job_def("training"), {"ops": {"sft": {"config": {"overrides": typed}}}})
    assert checked["ops"]["sft"]["config"]["overrides"] == typed
    from_launchpad = presets.resolve("sft", "smoke", checked["ops"]["sft"]["config"]["overrides"])
    from_flags = presets.resolve("sft", "smoke", parse_sets(flags))
    assert from_launchpad == from_flags
    assert (from_flags.budget.steps, from_flags.optim.lr, from_flags.data.allow_repeat) == (30, 0.002, True)


# ----------------------------------------------------------------------------------- MLflow


def test_runs_create_their_experiment_tagged_as_model_training(tmp_path):
    """A run logged to a fresh SQLite store creates its experiment with MLflow 3's experiment kind for
    model training; an experiment made before without the kind gets it from the next run."""
    from mlflow.tracking import MlflowClient

    from ghostvis_core.run.track.mlflow_run import EXPERIMENT_KIND_TAG, MlflowRun, MlflowTarget

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    older = client.create_experiment("made-before", artifact_location=(tmp_path / "a").as_uri())
    for name in ("ghostvis", "made-before"):
        run = MlflowRun(MlflowTarget(uri, name, artifact_location=(tmp_path / "a").as_uri()), {"stage": "sft"})
        run.log_metrics({"tokens/real": 1.0}, step=1)
        run.finish()
        assert client.get_experiment_by_name(name).tags[EXPERIMENT_KIND_TAG] == "custom_model_development"
    assert client.get_experiment(older).tags[EXPERIMENT_KIND_TAG] == "custom_model_development"


# ------------------------------------------------------------------------------------- staleness


@pytest.fixture
def copied_instance(home_copy):
    """The Dagster instance of a private copy of the demo home (its records get new materializations)."""
    from dagster import DagsterInstance

    instance = DagsterInstance.from_config(str(home_copy / "dagster"))
    yield instance
    instance.dispose()


def retrain(instance, asset: str) -> None:
    """A new materialization of `asset` with a new data version (what re-training it records)."""
    from dagster import AssetMaterialization

    instance.report_runless_asset_event(AssetMaterialization(asset, tags={"dagster/data_version": f"{asset}-again"}))


def unsynced_by(instance, changed: str) -> dict[str, list[str]]:
    """Asset -> its stale causes naming `changed`, as the Dagster UI computes them (its resolver)."""
    from dagster import AssetKey
    from dagster._core.definitions.data_version import CachingStaleStatusResolver
    from dagster._core.loader import LoadingContextForTest

    from ghostvis_pipeline.definitions import defs

    resolver = CachingStaleStatusResolver(instance, defs.resolve_asset_graph(), LoadingContextForTest(instance))
    out = {}
    for asset in [*STAGES, "evaluation", "report"]:
        causes = [
            c
            for c in resolver.get_stale_causes(AssetKey(asset))
            if c.dependency and c.dependency.asset_key == AssetKey(changed)
        ]
        if causes:
            out[asset] = [c.reason for c in causes]
    return out


def status_reasons(instance) -> dict[str, list[str]]:
    from ghostvis_pipeline.definitions import defs
    from ghostvis_pipeline.status_command import statuses

    return {s.asset: s.reasons for s in statuses(defs, instance)}


@pytest.mark.e2e
@pytest.mark.parametrize(
    "changed, above",
    [
        ("sft", ["dpo", "rl", "evaluation", "report"]),  # sft re-trained with a changed override
        ("pretrain", [*STAGES[1:], "evaluation", "report"]),
        ("tokenizer", [*STAGES, "evaluation", "report"]),  # a new vocabulary
    ],
)
def test_a_changed_stage_leaves_every_asset_above_it_unsynced(copied_instance, changed, above):
    """Not only the direct dependents: every asset made from the changed one is unsynced in the asset
    graph, each naming it, and `ghostvis status` says the same; the stages below stay synced."""
    assert unsynced_by(copied_instance, changed) == {}
    retrain(copied_instance, changed)
    unsynced = unsynced_by(copied_instance, changed)
    assert unsynced == {asset: ["has a new dependency data version"] for asset in above}
    reasons = status_reasons(copied_instance)
    for asset in above:
        assert [r for r in reasons[asset] if f"input {changed} changed" in r], (asset, reasons[asset])
    for asset in set(STAGES) - set(above) - {changed}:
        assert not [r for r in reasons[asset] if f"input {changed} " in r], (asset, reasons[asset])

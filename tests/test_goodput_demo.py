"""The undisturbed demo's goodput end to end, on the session's demo home (nothing trained here): per stage of the
lineage, `ghostvis goodput --lineage --json` through the real CLI accounts for the stage's step as Dagster logged
it, its productive steps are the ledger's committed steps (counted here in DuckDB over the run's parts), and the
same figures are the report card's, the run's MLflow metrics and the stage materialization's Dagster metadata."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ghostvis_core.home import Home
from tests.conftest import run_cli

WALL_SHARE = 0.02  # how far the categories' sum may be from the step's wall as Dagster logged it


def step_wall_s(instance, stage: str) -> tuple[float, object]:
    """The stage's latest materialization, and its step's wall in Dagster's event log: the step's start to its
    materialization."""
    from dagster import AssetKey, DagsterEventType

    ev = instance.get_latest_materialization_event(AssetKey(stage))
    starts = [e for e in instance.all_logs(ev.run_id, of_type=DagsterEventType.STEP_START) if e.step_key == ev.step_key]
    assert len(starts) == 1, f"{stage}: one attempt in the undisturbed demo, got {len(starts)}"
    return ev.timestamp - starts[0].timestamp, ev


def committed_steps(store: Path, stage: str, run_key: str) -> tuple[int, int]:
    """The steps of the run's ledger parts, and its last one (equal: each step committed once, none missing)."""
    import duckdb

    parts = f"read_parquet('{store}/ledger/parts/stage={stage}/run={run_key}/*.parquet')"
    return duckdb.connect().execute(f"SELECT sum(step_last - step_first + 1), max(step_last) FROM {parts}").fetchone()


def as_metrics(g: dict) -> dict[str, float]:
    """The CLI's figures under the names the run's MLflow metrics carry."""
    return {
        "goodput/ratio": g["goodput"],
        "goodput/wall_s": g["wall_s"],
        **{f"goodput/{k}_s": v for k, v in g["seconds"].items()},
        "goodput/redone_steps": g["redone_steps"],
        "goodput/tokens_once": g["tokens_once"],
        "goodput/tokens_thrown_away": g["tokens_thrown_away"],
    }


def report_card(instance, home: Home) -> tuple[dict, str]:
    """The report card's stages (report.json) and its markdown, read from the home's store where the report asset
    wrote them."""
    from tests.test_e2e_demo import latest

    name = Path(latest(instance, "report")["report_html"]).parent.name
    return json.loads(home.store.read_text("report", f"{name}/report.json")), home.store.read_text(
        "report", f"{name}/report.md"
    )


def goodput_row(md: str, stage: str) -> list[str]:
    """The stage's row of the report card's Goodput table."""
    table = md.split("## Goodput", 1)[1].split("\n## ", 1)[0]
    (found,) = [line for line in table.splitlines() if line.startswith(f"| {stage} |")]
    return [cell.strip() for cell in found.strip("|").split("|")]


@pytest.mark.e2e
def test_each_stages_goodput_adds_up_to_its_step_and_is_the_same_in_the_report_mlflow_and_dagster(demo_home):
    from dagster import DagsterInstance
    from mlflow.tracking import MlflowClient

    home = Home(demo_home)
    out = run_cli(["ghostvis", "goodput", "--lineage", "--json"], demo_home)
    figures = json.loads(out.stdout)
    instance = DagsterInstance.from_config(str(demo_home / "dagster"))
    stages, md = report_card(instance, home)
    assert [g["stage"] for g in figures] == [s["stage"] for s in stages] and len(figures) == 8
    client = MlflowClient(tracking_uri=home.mlflow_tracking_uri)
    for g, card in zip(figures, stages):
        stage, run_key = g["stage"], g["run_key"]
        wall_s, ev = step_wall_s(instance, stage)
        print(stage, f"step {wall_s:.3f} s, goodput's wall {g['wall_s']} s, sum {sum(g['seconds'].values()):.3f} s")
        assert abs(sum(g["seconds"].values()) - wall_s) <= WALL_SHARE * wall_s, (stage, wall_s, g)
        assert sum(g["seconds"].values()) == pytest.approx(g["wall_s"], abs=0.01)
        assert g["goodput"] > 0 and g["redone_steps"] == 0 and g["launches"] == 1 and g["faults"] == [], g
        steps, last = committed_steps(home.root / "store", stage, run_key)
        assert g["productive_steps"] == steps == last, (stage, steps, last, g)
        assert card["run_key"] == run_key and card["goodput"] == g
        shown = [f"{v:.4g}" for v in (g["goodput"], g["wall_s"], *g["seconds"].values())]
        assert goodput_row(md, stage) == [stage, run_key, *shown]
        logged = {
            k: v for k, v in client.get_run(card["mlflow_run_id"]).data.metrics.items() if k.startswith("goodput/")
        }
        assert logged == as_metrics(g), stage
        dagster = {k: getattr(v, "value", v) for k, v in ev.asset_materialization.metadata.items()}
        assert dagster["goodput_breakdown"] == g
        assert {k: dagster[k.replace("/", "_").replace("goodput_ratio", "goodput")] for k in logged} == logged

"""What a person sees: after the smoke demo, the Dagster UI (dagster-webserver) and the MLflow UI
(`mlflow server`) run on 127.0.0.1 and headless Chromium (Debian's, driven by Playwright) opens them:
the asset graph lists every asset, the `sft` page shows its token metadata and passed checks, the
MLflow experiment lists one run per stage materialization with `tokens/real` charted, and the report
card renders with its image and the ledger's token figures. Screenshots go to test-artifacts/ui/."""

from __future__ import annotations

import json
import re
import urllib.parse
from pathlib import Path

import pytest
from playwright.sync_api import expect

from ghostvis_core.data.ledger import Ledger
from ghostvis_core.home import Home
from ghostvis_core.plan.stages import stage_names
from ghostvis_core.verify.audit.stage_checks import stage_check_names
from ghostvis_core.verify.replay.check import NAME as REPLAY_CHECK
from tests.ui_servers import (
    UI_TIMEOUT_MS,
    as_int,
    dagster_ui,
    eventually,
    mlflow_server,
    shot,
)

pytestmark = pytest.mark.e2e

STAGES = stage_names()
# The asset graph as the issue lists it, every stage of the chain (the UI must show at least these; exactly
# the code location's).
ASSETS = [
    "shard_manifest",
    "raw_shards",
    "tokenizer",
    "tokenized_shards",
    "token_ledger",
    *STAGES,
    "pretrain_variants",
    "evaluation",
    "report",
]
STAGE_CHECKS = stage_check_names()  # the one registry (ghostvis_core/verify/audit/stage_checks.py)
TOKEN_COLS = {"real": "real_tokens", "pad": "pad_tokens", "loss": "loss_tokens", "cropped": "cropped_tokens"}
expect.set_options(timeout=UI_TIMEOUT_MS)
VIEWPORT = (1600, 1400)  # the `page` fixture's size (conftest.py)


# --------------------------------------------------------------------------------------- services


@pytest.fixture(scope="module")
def dagster_url(demo_home):
    with dagster_ui(demo_home, "dagster-webserver") as url:
        yield url


@pytest.fixture(scope="module")
def mlflow_url(demo_home, module_tmp):
    with mlflow_server(demo_home, "mlflow-server", module_tmp("mlflow_cwd")) as url:
        yield url


# ----------------------------------------------------------------------------- expected numbers


@pytest.fixture(scope="module")
def instance(demo_home):
    from dagster import DagsterInstance

    with DagsterInstance.from_config(str(demo_home / "dagster")) as inst:
        yield inst


def materializations(instance, asset: str) -> list[dict]:
    """Every materialization's metadata of `asset`, newest first (raw values)."""
    from dagster import AssetKey

    records = instance.fetch_materializations(AssetKey(asset), limit=1000).records
    return [{k: getattr(v, "value", v) for k, v in r.asset_materialization.metadata.items()} for r in records]


def ledger_totals(demo_home, run_key: str) -> dict:
    return Ledger.in_store(Home(demo_home).store).run_totals(run_key).as_dict()


# ---------------------------------------------------------------------------------------- Dagster


def test_dagster_catalog_and_lineage_list_every_asset(page, dagster_url):
    from ghostvis_pipeline.definitions import defs

    defined = {k.to_user_string() for k in defs.resolve_all_asset_keys()}
    assert set(ASSETS) <= defined

    # the catalog: one row (a link to /assets/<name>) per asset
    page.goto(f"{dagster_url}/assets")
    page.get_by_text("shard_manifest", exact=True).first.wait_for()
    page.get_by_text("vision_alignment", exact=True).first.wait_for()

    def listed() -> set[str]:
        hrefs = page.eval_on_selector_all(
            "a[href^='/assets/']", "els => els.filter(e => e.offsetParent !== null).map(e => e.getAttribute('href'))"
        )
        return {urllib.parse.unquote(h[len("/assets/") :]) for h in hrefs if "?" not in h and h.count("/") == 2}

    names = eventually(listed, lambda n: n == defined)
    assert names == defined, f"catalog lists {sorted(names)}; defined: {sorted(defined)}"
    # the demo materialized them (the partitioned ones show partition counts instead)
    for asset in ["shard_manifest", "tokenizer", "token_ledger", *STAGES, "evaluation", "report"]:
        row = page.locator("[class*='VirtualizedTable_row']", has=page.locator(f"a[href='/assets/{asset}']"))
        expect(row.first).to_contain_text("Materialized")
    shot(page, "dagster-asset-catalog")

    # the global lineage graph with every group expanded: one node per asset
    groups = ",".join(f"global@global:{g}" for g in ("data", "training", "eval"))
    page.goto(f"{dagster_url}/asset-groups?expanded={urllib.parse.quote(groups)}")
    graph = page.locator("svg foreignObject")
    for asset in sorted(defined):
        node = graph.get_by_text(asset, exact=True).first
        node.wait_for(state="visible")
    shot(page, "dagster-asset-lineage")


def test_dagster_sft_page_shows_ledger_token_metadata_and_passed_checks(page, dagster_url, demo_home, instance):
    md = materializations(instance, "sft")[0]
    totals = ledger_totals(demo_home, md["run_key"])

    page.goto(f"{dagster_url}/assets/sft")
    page.get_by_text("Metadata", exact=True).first.wait_for()
    page.get_by_text("real_tokens", exact=True).first.wait_for()
    shown = {}
    for key in ("run_key", "real_tokens", "pad_tokens", "loss_tokens", "cropped_tokens", "planned_tokens", "steps"):
        row = page.locator("tr", has=page.locator("td:first-child", has_text=re.compile(f"^{key}$"))).first
        shown[key] = row.locator("td").last.inner_text().strip()
    page.set_viewport_size({"width": 1600, "height": 3200})  # the UI scrolls inside: show all metadata
    page.get_by_text("shards_consumed", exact=True).first.wait_for()
    shot(page, "dagster-sft-overview")
    page.set_viewport_size({"width": 1600, "height": 1400})
    assert shown["run_key"] == md["run_key"]
    for key in ("real_tokens", "pad_tokens", "loss_tokens", "cropped_tokens"):
        assert as_int(shown[key]) == totals[key] == md[key], (key, shown[key], totals[key])
    assert as_int(shown["real_tokens"]) + as_int(shown["pad_tokens"]) == as_int(shown["planned_tokens"])
    assert as_int(shown["steps"]) == totals["steps"]

    # the checks tab: every stage check listed and passed for this materialization
    from ghostvis_pipeline.checks import stage_checks

    descriptions = {spec.name: spec.description for c in stage_checks("sft") for spec in c.check_specs}
    assert sorted(descriptions) == sorted(STAGE_CHECKS)
    page.goto(f"{dagster_url}/assets/sft?view=checks")
    page.get_by_text(f"Checks ({len(STAGE_CHECKS) + 1})", exact=True).wait_for()  # and replay_matches
    for check in [*STAGE_CHECKS, REPLAY_CHECK]:  # the list: name, then its status
        entry = page.locator(f"[title='{check}']").first.locator("xpath=..")
        expect(entry).to_contain_text("Succeeded")
    shot(page, "dagster-sft-checks")
    for check in STAGE_CHECKS:  # each check's panel: what it checks, and its latest evaluation
        page.goto(f"{dagster_url}/assets/sft?view=checks&checkDetail={check}")
        page.get_by_text(descriptions[check], exact=True).wait_for()
        result = page.get_by_text("Evaluation result", exact=True).locator("xpath=..")
        expect(result).to_contain_text("Passed")
        if check == "ledger_mlflow_metadata_agree":  # its comparison table, as the user opens it
            page.get_by_text("[Show Markdown]").first.click()
            dialog = page.get_by_role("dialog").first
            expect(dialog).to_contain_text("comparison")
            for key in ("real_tokens", "pad_tokens", "loss_tokens", "cropped_tokens"):
                cells = dialog.locator("tr", has=page.locator("td", has_text=re.compile(f"^{key}$"))).first
                texts = [t.strip() for t in cells.locator("td").all_inner_texts()]
                # ledger, MLflow, run record, Dagster metadata, then the verdict
                assert texts[0] == key and [as_int(t) for t in texts[1:5]] == [totals[key]] * 4, texts
                assert texts[5] == "ok", texts
            shot(page, f"dagster-sft-check-{check}")
            dialog.get_by_role("button", name="Close").click()
        else:
            shot(page, f"dagster-sft-check-{check}")


# ----------------------------------------------------------------------------------------- MLflow


def test_mlflow_lists_one_run_per_stage_materialization_with_tokens_real_charted(page, mlflow_url, demo_home, instance):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(Home(demo_home).mlflow_tracking_uri)
    exp = client.get_experiment_by_name("ghostvis")
    runs = client.search_runs([exp.experiment_id], max_results=500)
    # one MLflow run per Dagster materialization of each stage (the demo: one each)
    expected = {stage: {m["run_key"] for m in materializations(instance, stage)} for stage in STAGES}
    assert all(expected.values()), expected
    by_name = {r.info.run_name: r for r in runs}

    # the experiment's run list
    page.goto(f"{mlflow_url}/#/experiments/{exp.experiment_id}/runs")
    page.get_by_text("ghostvis", exact=True).first.wait_for()
    for name in sorted(by_name):
        page.get_by_text(name, exact=True).first.wait_for()
    page.get_by_text(f"{len(runs)} matching runs").wait_for()
    shot(page, "mlflow-experiment-runs")

    # the same runs compared side by side: each run's name and its ghostvis.stage tag
    ids = [r.info.run_id for r in runs]
    page.goto(f"{mlflow_url}/#/compare-runs?runs={json.dumps(ids)}&experiments={json.dumps([exp.experiment_id])}")
    page.get_by_text("ghostvis.stage", exact=True).wait_for()
    name_row = page.locator("tr", has=page.locator("th", has_text=re.compile(r"^Run Name:?$"))).first
    stage_row = page.locator("tr", has=page.locator("th, td", has_text=re.compile(r"^ghostvis\.stage$"))).first
    names = [c.strip() for c in name_row.locator("td").all_inner_texts()]
    stages = [c.strip() for c in stage_row.locator("td").all_inner_texts()]
    stages = stages[-len(names) :]  # the tag table's first cell is the tag name
    shot(page, "mlflow-compare-runs")
    seen: dict[str, set[str]] = {}
    for name, stage in zip(names, stages):
        seen.setdefault(stage, set()).add(name)
    assert seen == expected, f"UI shows {seen}; Dagster materialized {expected}"

    # tokens/real of every stage run on one chart, and its table of latest values
    params = (
        f"?runs={json.dumps(ids)}&metric={urllib.parse.quote(json.dumps('tokens/real'))}"
        f"&experiments={json.dumps([exp.experiment_id])}"
        f"&plot_metric_keys={urllib.parse.quote(json.dumps(['tokens/real']))}"
        "&plot_layout={}&x_axis=step&y_axis_scale=linear&line_smoothness=1&show_point=true"
        "&deselected_curves=[]&last_linear_y_axis_range=[]"
    )
    page.goto(f"{mlflow_url}/#/metric{params}")
    page.get_by_text(f"{len(runs)}/{len(runs)}", exact=True).wait_for()  # "Completed Runs n/n": every history loaded
    chart = page.locator(".js-plotly-plot").first
    chart.wait_for()
    for name in by_name:  # the chart's legend
        page.get_by_text(f"{name} (tokens/real)", exact=True).wait_for()
    # the curves drawn (plotly's figure data on its div): each run's last point is (steps, real tokens)
    curves = chart.evaluate("e => e.data.map(t => ({name: t.name, x: Array.from(t.x), y: Array.from(t.y)}))")
    assert {c["name"] for c in curves} == set(by_name), curves
    for c in curves:
        totals = ledger_totals(demo_home, c["name"])
        assert (c["x"][-1], c["y"][-1]) == (totals["steps"], totals["real_tokens"]), (c, totals)
    latest: dict[str, str] = {}
    for name in by_name:
        row = page.locator("tr", has=page.get_by_role("link", name=name, exact=True)).first
        latest[name] = row.locator("td").nth(1).inner_text().strip()
    shot(page, "mlflow-tokens-real")
    for name, text in latest.items():
        m = re.fullmatch(r"([\d,.]+) \(step=(\d+)\)", text)
        assert m, (name, text)
        totals = ledger_totals(demo_home, name)  # the run name is the run key
        assert float(m.group(1).replace(",", "")) == totals["real_tokens"], (name, text, totals)
        assert int(m.group(2)) == totals["steps"], (name, text, totals)

    # a stage's run page: its tag and its tokens/real as a person reads them
    sft = materializations(instance, "sft")[0]
    page.goto(f"{mlflow_url}/#/experiments/{exp.experiment_id}/runs/{sft['mlflow_run_id']}")
    page.get_by_text(sft["run_key"], exact=True).first.wait_for()
    metric_row = page.get_by_role("row").filter(has=page.get_by_role("cell", name="tokens/real", exact=True)).first
    metric_cells = metric_row.get_by_role("cell")
    expect(metric_cells).to_have_count(3)  # the model column fills in after the run's logged models load
    name_cell, value, model = metric_cells.all_inner_texts()  # the model logged into the run
    assert (name_cell, as_int(value), model) == ("tokens/real", sft["real_tokens"], "sft")
    stage_tag = page.locator("span", has=page.locator("[title='ghostvis.stage']")).last
    expect(stage_tag).to_have_text("ghostvis.stage: sft")
    shot(page, "mlflow-sft-run")


# ----------------------------------------------------------------------------------------- report


def test_report_renders_with_images_and_the_ledgers_token_figures(page, demo_home, instance):
    md = materializations(instance, "report")[0]
    report = Path(md["report_html"])
    assert report.is_file(), report
    failed: list[str] = []
    page.on("requestfailed", lambda r: failed.append(r.url))
    page.goto(report.as_uri())
    page.wait_for_load_state("load")
    images = page.eval_on_selector_all(
        "img",
        "els => els.map(e => ({src: e.getAttribute('src'), done: e.complete, w: e.naturalWidth,"
        " h: e.naturalHeight, shown: e.getBoundingClientRect().width}))",
    )
    shot(page, "report")
    assert images, "the report has no image"
    for img in images:
        assert img["done"] and img["w"] > 0 and img["h"] > 0 and img["shown"] > 0, img
    assert not failed, failed

    table = page.locator("h2", has_text="Tokens (ledger)").locator("xpath=following-sibling::table[1]")
    rows = table.locator("tr[data-stage]")
    assert rows.count() == len(STAGES)
    shown_stages = []
    for i in range(rows.count()):
        row = rows.nth(i)
        stage = row.get_attribute("data-stage")
        shown_stages.append(stage)
        run_key = row.locator("td[data-col='run']").inner_text().strip()
        assert run_key.startswith(f"{stage}-"), (stage, run_key)
        totals = ledger_totals(demo_home, run_key)
        for col, key in TOKEN_COLS.items():
            text = row.locator(f"td[data-col='{col}']").inner_text()
            assert as_int(text) == totals[key], (stage, col, text, totals[key])
        assert as_int(row.locator("td[data-col='steps']").inner_text()) == totals["steps"]
    assert shown_stages == STAGES

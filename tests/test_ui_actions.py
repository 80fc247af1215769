"""The UIs operated as a person operates them (issue 27): headless Chromium drives `dagster dev`
(webserver and daemon, so runs launched from the UI leave the queue) and `mlflow server` on one
writable copy of the smoke demo home. It materializes `sft` from the Launchpad with an override typed
as a person types it, reads the stale marks and the checks the run left, terminates a training run
and resumes it, compares two pretraining variants in MLflow and backfills shards of a new source.
Every figure read in a page is compared with the ledger, the Dagster instance or MLflow. The
walk-through screenshots (README, "Using the UIs") are written to test-artifacts/ui/NN-*.png.

The tests share the servers and the home, and run in file order: the stale marks and the checks are
those of the sft run launched first; the backfill adds a source last, so no training before it sees it."""

from __future__ import annotations

import json
import re
import time
import urllib.parse
from pathlib import Path

import psutil
import pytest
import yaml
from playwright.sync_api import expect

from ghostvis_core.home import Home
from ghostvis_core.launch.cluster.torchrun_command import AGENT_MODULE
from ghostvis_core.plan.presets import VARIANTS
from ghostvis_core.run.train import checkpoint as ckpt
from ghostvis_core.verify.audit.stage_checks import stage_check_names
from ghostvis_core.verify.replay.check import NAME as REPLAY_CHECK
from tests.conftest import copy_home, materialize, new_run_dirs, run_cli, run_names
from tests.ui_servers import (
    UI_TIMEOUT_MS,
    as_int,
    captured_page,
    dagster_ui,
    eventually,
    mlflow_server,
    shot,
)

pytestmark = pytest.mark.e2e
expect.set_options(timeout=UI_TIMEOUT_MS)
VIEWPORT = (1280, 800)  # the `page` fixture's size (conftest.py)

RUN_TIMEOUT_S = 900  # a training run launched from the UI, on a loaded 2-core machine
SFT_STEPS = 12  # the smoke preset trains sft for 8: the override changes the run
PRETRAIN_OVERRIDES = {"budget.steps": 24, "checkpoint.every_steps": 4}  # terminated after the first checkpoint
VARIANT_STEPS = 6
COMPARED = ["lr_1e-3", "lr_4e-3"]  # pretrain_variants partitions: AdamW at two learning rates
NEW_SOURCE = "ui_notes"  # the text source the backfill tokenizes
TOKEN_FIGURES = ["real_tokens", "pad_tokens", "loss_tokens", "cropped_tokens"]
FINISHED = {"SUCCESS", "FAILURE", "CANCELED"}
RUN_PAGE = re.compile(r"/runs/([0-9a-f-]{36})")
BACKFILL_ENDED = {"COMPLETED", "COMPLETED_SUCCESS", "COMPLETED_FAILED", "FAILED", "CANCELED"}
# Dagster's words for a stale cause (dagster/_core/definitions/data_version.py) and `ghostvis status`'s
UI_CAUSES = {
    "has a new code version": "code",
    "has a new dependency on": "new input",
    "has a new data version": "input changed",
    "has a new materialization": "input changed",
}
STATUS_CAUSES = [
    (re.compile(r"^its code changed"), "code"),
    (re.compile(r"^new input (\S+)$"), "new input"),
    (re.compile(r"^input (\S+) changed"), "input changed"),
]
# Each check's comparisons as pairs of metadata entries: both sides are shown, and equal when it passed.
CHECK_SIDES = {
    "tokens_recounted_from_files": [(f"{f}_trainer", f"{f}_recount") for f in TOKEN_FIGURES],
    "tokens_match_plan": [("planned_tokens", "consumed_tokens")],
    "consumption_matches_plan": [
        ("steps_planned", "steps_trained"),
        ("rows_planned", "rows_recorded"),
        ("planned_tokens", "consumed_positions"),
    ],
}


# --------------------------------------------------------------------------------------- services


@pytest.fixture(scope="module")
def home(demo_home, module_tmp) -> Path:
    """One writable copy of the demo home for the whole file."""
    return copy_home(demo_home, module_tmp("ui_actions") / "home")


@pytest.fixture(scope="module")
def mlflow_url(home, module_tmp):
    with mlflow_server(home, "actions-mlflow-server", module_tmp("mlflow_cwd")) as url:
        yield url


@pytest.fixture(scope="module")
def dagster_url(home, mlflow_url):
    """`dagster dev`: its daemon dequeues the UI's runs and runs backfills; metadata links open this MLflow."""
    with dagster_ui(home, "actions-dagster-dev", daemon=True, GHOSTVIS_MLFLOW_UI=mlflow_url) as url:
        yield url


@pytest.fixture(scope="module")
def instance(home):
    from dagster import DagsterInstance

    with DagsterInstance.from_config(str(home / "dagster")) as inst:
        yield inst


@pytest.fixture(scope="module")
def mlflow(home):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(Home(home).mlflow_tracking_uri)
    return client, client.get_experiment_by_name("ghostvis").experiment_id


def step(name: str, pg) -> None:
    """A walk-through screenshot: the viewport as a person sees it."""
    shot(pg, name, full_page=False)


# ------------------------------------------------------------------------------- Dagster actions


def open_launchpad(pg, dagster_url: str, asset: str):
    """The asset's Launchpad: shift-click on its Materialize button."""
    pg.goto(f"{dagster_url}/assets/{asset}")
    pg.locator("button", has_text=re.compile(r"^Materialize$")).first.click(modifiers=["Shift"])
    dialog = pg.get_by_role("dialog")
    dialog.get_by_text("Launchpad (configure assets)").wait_for()
    return dialog


def editor_text(dialog) -> str:
    return dialog.locator(".CodeMirror").first.evaluate("e => e.CodeMirror.getValue()")


def type_config(pg, dialog, overrides: dict[str, int], force: bool = False) -> dict:
    """Type the overrides into the run config's `overrides: {}` line, one `key: value` line each, as a
    person types YAML (the editor keeps the indentation of the line above); `force: true` the same way.
    Returns the asset's config as the editor now holds it."""
    if force:
        dialog.locator(".CodeMirror-line", has_text="force: false").first.click()
        pg.keyboard.press("End")
        for _ in "false":
            pg.keyboard.press("Backspace")
        pg.keyboard.type("true")
    dialog.locator(".CodeMirror-line", has_text="overrides: {}").first.click()
    pg.keyboard.press("End")
    pg.keyboard.press("Backspace")
    pg.keyboard.press("Backspace")
    for i, (key, value) in enumerate(overrides.items()):
        pg.keyboard.press("Enter")
        pg.keyboard.type(f"{'  ' if i == 0 else ''}{key}: {value}")
    dialog.get_by_text("No errors").wait_for()
    ops = yaml.safe_load(editor_text(dialog))["ops"].values()
    (config,) = [op["config"] for op in ops if "overrides" in op["config"]]  # the asset's, not a check's
    return config


def launch(pg, dialog) -> str:
    """Click the Launchpad's Materialize: the UI opens the run's page (or says "Launched run" with a
    View link, then that is clicked). The run's id, from the page's URL."""
    dialog.locator("button", has_text=re.compile(r"^Materialize$")).click()
    toast = pg.get_by_text("Launched run")
    eventually(lambda: RUN_PAGE.search(pg.url) or toast.count(), bool)
    if not RUN_PAGE.search(pg.url):
        pg.get_by_role("link", name="View", exact=True).click()
    pg.wait_for_url(RUN_PAGE)
    return RUN_PAGE.search(pg.url).group(1)


def finished_run(instance, run_id: str, timeout_s: float = RUN_TIMEOUT_S):
    run = eventually(lambda: instance.get_run_by_id(run_id), lambda r: r.status.value in FINISHED, timeout_s, 2)
    assert run.status.value in FINISHED, f"run {run_id} still {run.status.value} after {timeout_s} s"
    return run


def events_of(entries, kind: str) -> list:
    return [e for e in entries if e.dagster_event_type is not None and e.dagster_event_type.name == kind]


def step_messages(entries, step_key: str) -> list[str]:
    """What a step logged, and the error its failure carried."""
    out = []
    for e in entries:
        if e.step_key == step_key:
            out.append(e.user_message or "")
            if e.dagster_event is not None and e.dagster_event.is_step_failure:
                out.append(e.dagster_event.step_failure_data.error.message)
    return out


def show_run(pg, dagster_url: str, run_id: str, status: str) -> None:
    """The run page, once its header says `status` and its event log shows the run's last event."""
    pg.goto(f"{dagster_url}/runs/{run_id}")
    pg.get_by_text(status, exact=True).first.wait_for()
    pg.get_by_text(f"RUN_{status.upper()}", exact=True).first.wait_for()


def metadata_value(scope, key: str) -> str:
    """A metadata table's value for `key`, as displayed (the row whose first cell is the key)."""
    row = scope.locator("tr", has=scope.locator("td:first-child", has_text=re.compile(f"^{re.escape(key)}$"))).first
    return row.locator("td").last.inner_text().strip()


def cli_json(home: Path, *args: str):
    return json.loads(run_cli(["ghostvis", *args, "--json"], home).stdout)


# ------------------------------------------------------------------- 1. materialize with a config


@pytest.fixture(scope="module")
def sft_launch(home, dagster_url, browser, instance, mlflow, request):
    """sft launched from its Launchpad with `budget.steps: 12` typed in: (run id, config as typed,
    MLflow run ids before the launch)."""
    client, exp = mlflow
    before = {r.info.run_id for r in client.search_runs([exp], max_results=1000)}
    with captured_page(browser, request, *VIEWPORT, name="sft_launch") as pg:
        dialog = open_launchpad(pg, dagster_url, "sft")
        config = type_config(pg, dialog, {"budget.steps": SFT_STEPS})
        step("01-launchpad", pg)
        run_id = launch(pg, dialog)
        finished_run(instance, run_id)
        show_run(pg, dagster_url, run_id, "Success")
        step("02-run-succeeded", pg)
    return run_id, config, before


def test_launchpad_override_typed_as_yaml_trains_sft_and_its_figures_show(
    page, home, dagster_url, instance, mlflow, sft_launch
):
    run_id, config, mlflow_before = sft_launch
    assert config["overrides"] == {"budget.steps": SFT_STEPS}  # an int, as typed
    run = instance.get_run_by_id(run_id)
    assert run.status.value == "SUCCESS"
    assert run.run_config["ops"]["sft"]["config"]["overrides"] == {"budget.steps": SFT_STEPS}

    entries = instance.all_logs(run_id)
    evaluations = [e.dagster_event.event_specific_data for e in events_of(entries, "ASSET_CHECK_EVALUATION")]
    assert sorted(ev.check_name for ev in evaluations) == sorted([*stage_check_names(), REPLAY_CHECK])
    assert all(ev.passed for ev in evaluations), [ev.check_name for ev in evaluations if not ev.passed]
    (materialized,) = events_of(entries, "ASSET_MATERIALIZATION")
    md = {k: getattr(v, "value", v) for k, v in materialized.asset_materialization.metadata.items()}

    # a new MLflow run, finished, with the override among its params
    client, _ = mlflow
    assert md["mlflow_run_id"] not in mlflow_before
    mlflow_run = client.get_run(md["mlflow_run_id"])
    assert (mlflow_run.info.status, mlflow_run.info.run_name) == ("FINISHED", md["run_key"])
    assert mlflow_run.data.params["budget.steps"] == str(SFT_STEPS)

    # the asset page shows the new materialization's four token figures: the ledger's
    ledger = cli_json(home, "ledger", "--run", "sft")
    assert (ledger["run_key"], ledger["steps"]) == (md["run_key"], SFT_STEPS)
    page.goto(f"{dagster_url}/assets/sft")
    page.get_by_text("real_tokens", exact=True).first.wait_for()
    shown = {key: metadata_value(page, key) for key in ["run_key", *TOKEN_FIGURES, "steps"]}
    page.get_by_text("real_tokens", exact=True).first.scroll_into_view_if_needed()
    step("03-sft-token-figures", page)
    assert shown["run_key"] == md["run_key"]
    assert {k: as_int(shown[k]) for k in TOKEN_FIGURES} == {k: ledger[k] for k in TOKEN_FIGURES}
    assert as_int(shown["steps"]) == SFT_STEPS


# ------------------------------------------------------------------ 4. stale where people look


def status_causes(reasons: list[str], asset: str) -> set[tuple[str, str]]:
    """`ghostvis status` reasons as (kind, asset) pairs."""
    out = set()
    for reason in reasons:
        for pattern, kind in STATUS_CAUSES:
            m = pattern.match(reason)
            if m:
                out.add((kind, m.group(1) if m.groups() else asset))
                break
        else:
            raise AssertionError(f"{asset}: unrecognised status reason {reason!r}")
    return out


def ui_causes(pg, dagster_url: str, asset: str) -> tuple[int, set[tuple[str, str]]]:
    """The asset page's Unsynced tag, hovered: (its count, its causes as (kind, asset) pairs)."""
    pg.goto(f"{dagster_url}/assets/{asset}")
    tag = pg.locator("button", has_text=re.compile(r"^Unsynced \(\d+\)$")).first
    count = int(re.search(r"\d+", tag.inner_text()).group())
    tag.hover()
    popover = pg.locator(".bp5-popover-content").filter(has_text="since last materialization").first
    popover.wait_for()
    causes = set()
    for row in popover.locator("div[class*='flexRow']", has=pg.locator("a[href^='/assets/']")).all():
        named = row.locator("a[href^='/assets/']").first.inner_text().strip()
        words = row.locator(":scope > span").first.inner_text().strip()
        assert words in UI_CAUSES, f"{asset}: unrecognised stale cause {row.inner_text()!r}"
        causes.add((UI_CAUSES[words], named))
    return count, causes


def descendants(asset: str) -> list[str]:
    """Every asset downstream of `asset` in the code location."""
    from dagster import AssetKey

    from ghostvis_pipeline.definitions import defs

    graph = defs.resolve_asset_graph()
    found, todo = set(), [AssetKey(asset)]
    while todo:
        for child in graph.get(todo.pop()).child_keys - found:
            found.add(child)
            todo.append(child)
    return sorted(k.to_user_string() for k in found)


def graph_marks(pg, dagster_url: str, asset: str) -> dict[str, int]:
    """The asset's downstream lineage graph, zoomed in until nodes show their details: per node, its
    Unsynced count (0: none shown)."""
    pg.goto(f"{dagster_url}/assets/{asset}?view=lineage&lineageScope=downstream&lineageDepth=10")
    nodes = pg.locator("svg foreignObject")
    nodes.get_by_text(asset, exact=True).first.wait_for()

    def texts() -> list[str]:
        return [t for t in nodes.evaluate_all("els => els.map(e => e.textContent)") if "Latest event" in t]

    for _ in range(6):
        if texts():
            break
        pg.locator("button:has([aria-label='zoom_in'])").first.click()
        time.sleep(0.5)
    marks = {}
    for text in eventually(texts, bool):
        m = re.match(r"^(?:Unsynced \((\d+)\))?([a-z0-9_]+?)Latest event", text)
        assert m, text
        marks[m.group(2)] = int(m.group(1) or 0)
    return marks


def test_asset_graph_marks_everything_down_the_chain_unsynced_with_the_status_reasons(
    page, home, dagster_url, sft_launch
):
    below = descendants("sft")
    assert {"dpo", "rl", "evaluation", "report"} <= set(below)
    status = {s["asset"]: s for s in cli_json(home, "status")}
    expected = {a: status_causes(status[a]["reasons"], a) for a in below}
    for asset in below:  # each one names sft among its reasons (a new input where its code changed since)
        assert status[asset]["state"] == "stale" and "sft" in {name for _, name in expected[asset]}, status[asset]

    marks = graph_marks(page, dagster_url, "sft")
    step("04-unsynced-down-the-chain", page)
    assert marks == {
        "sft": len(status_causes(status["sft"]["reasons"], "sft")),
        **{a: len(expected[a]) for a in below},
    }, (marks, status)
    for asset in below:
        count, causes = ui_causes(page, dagster_url, asset)
        if asset == "dpo":  # the popover scrolled to sft's entry
            page.locator(".bp5-popover-content a[href='/assets/sft']").first.scroll_into_view_if_needed()
            step("05-unsynced-reasons", page)
        assert (count, causes) == (len(expected[asset]), expected[asset]), (asset, status[asset]["reasons"])


# ------------------------------------------------------------------------------ 5. checks readable


def test_sft_checks_show_both_sides_of_every_comparison(page, dagster_url, instance, sft_launch):
    from dagster import AssetCheckKey, AssetKey

    run_id, _, _ = sft_launch
    page.goto(f"{dagster_url}/assets/sft?view=checks")
    page.get_by_text(f"Checks ({len(stage_check_names()) + 1})", exact=True).wait_for()  # and replay_matches
    for check in [*stage_check_names(), REPLAY_CHECK]:
        expect(page.locator(f"[title='{check}']").first.locator("xpath=..")).to_contain_text("Succeeded")
    step("06-sft-checks", page)

    for check, pairs in CHECK_SIDES.items():
        (record,) = instance.event_log_storage.get_asset_check_execution_history(
            AssetCheckKey(AssetKey("sft"), check), limit=1
        )
        assert record.run_id == run_id
        evaluation = record.event.dagster_event.event_specific_data
        recorded = {k: getattr(v, "value", v) for k, v in evaluation.metadata.items()}
        page.goto(f"{dagster_url}/assets/sft?view=checks&checkDetail={check}")
        expect(page.get_by_text("Evaluation result", exact=True).locator("xpath=..")).to_contain_text("Passed")
        page.get_by_text("Metadata", exact=True).first.wait_for()
        for left, right in pairs:
            shown = (as_int(metadata_value(page, left)), as_int(metadata_value(page, right)))
            assert shown == (recorded[left], recorded[right]), (check, left, right, shown)
            assert shown[0] == shown[1], (check, left, right, shown)
        if check == "tokens_recounted_from_files":
            page.get_by_text("real_tokens_trainer", exact=True).first.scroll_into_view_if_needed()
            step("07-check-both-sides", page)


# --------------------------------------------------------------------------------- 3. terminate


def torchrun_of(home: Path):
    """The torchrun process training a stage of `home` (its spec is in the home's store), or None."""
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if AGENT_MODULE in cmd and any(str(home) in part for part in cmd):
            return proc
    return None


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def training_pids(home: Path, known: set[str]) -> list[int]:
    """Once the run started in `home` (a run folder not in `known`) has committed its first checkpoint:
    the pids of its torchrun and of the ranks under it."""

    def committed() -> int:
        dirs = new_run_dirs(home, known)
        return max((c.step for c in ckpt.list_complete(dirs[-1])), default=0) if dirs else 0

    assert eventually(committed, lambda s: s >= PRETRAIN_OVERRIDES["checkpoint.every_steps"], RUN_TIMEOUT_S, 0.5)
    torchrun = torchrun_of(home)
    assert torchrun is not None, "no torchrun process while the run trains"
    pids = [torchrun.pid, *(p.pid for p in torchrun.children(recursive=True))]
    assert len(pids) >= 3, f"torchrun and its two ranks: {pids}"
    return pids


def assert_stopped_for_good(instance, home: Path, run_id: str, pids: list[int]) -> None:
    """The run ended Canceled, saying so; its processes are gone and no retry started another torchrun."""
    assert finished_run(instance, run_id, 300).status.value == "CANCELED"
    assert eventually(lambda: [p for p in pids if not gone(p)], lambda alive: not alive, 60) == []
    time.sleep(5)  # the retry policy's delay is 2 s: a retry would have launched by now
    assert torchrun_of(home) is None, "a torchrun is training after the run was terminated"
    entries = instance.all_logs(run_id)
    assert events_of(entries, "STEP_UP_FOR_RETRY") == []
    assert sum("launching:" in (e.user_message or "") for e in entries) == 1
    assert events_of(entries, "RUN_CANCELED")
    said = [m for m in step_messages(entries, "pretrain") if re.search(r"terminat|cancel", m, re.I)]
    assert said, "no message of the pretrain step says it was terminated"


def test_terminate_stops_training_without_retry_and_materializing_again_resumes(page, home, dagster_url, instance):
    known = run_names(home)
    dialog = open_launchpad(page, dagster_url, "pretrain")
    config = type_config(page, dialog, PRETRAIN_OVERRIDES, force=True)
    assert (config["force"], config["overrides"]) == (True, PRETRAIN_OVERRIDES)
    run_id = launch(page, dialog)
    pids = training_pids(home, known)

    page.locator("button", has_text=re.compile(r"^Terminate$")).click()
    step("08-terminate", page)
    page.get_by_role("dialog").locator("button", has_text=re.compile(r"^Terminate 1 run$")).click()
    assert_stopped_for_good(instance, home, run_id, pids)
    show_run(page, dagster_url, run_id, "Canceled")
    step("09-canceled", page)

    # materialize again (Re-execute, the same config): resumes the run from its last committed checkpoint
    (run_dir,) = new_run_dirs(home, known)
    resumed_from = ckpt.latest_complete(run_dir).step
    page.locator("button", has_text=re.compile(r"^Re-execute all")).first.click()
    page.wait_for_url(lambda url: bool(RUN_PAGE.search(url)) and run_id not in url)
    rerun_id = RUN_PAGE.search(page.url).group(1)
    assert finished_run(instance, rerun_id).status.value == "SUCCESS"
    assert new_run_dirs(home, known) == [run_dir]  # the same run, resumed: no new attempt
    ledger = cli_json(home, "ledger", "--run", "pretrain")
    assert ledger["run_key"] == run_dir.name and ledger["steps"] == PRETRAIN_OVERRIDES["budget.steps"]
    segments = ledger["segments"]
    assert len(segments) == 2, segments
    assert segments[1]["first_step"] == resumed_from + 1, (segments, resumed_from)
    assert ledger["overlap_tokens"] == 0
    audit = run_cli(["ghostvis", "audit", "--stage", "pretrain"], home, check=False)
    assert audit.returncode == 0, audit.stdout[-3000:]


# ------------------------------------------------------------------------------ 6. MLflow compare


def close_assistant(pg) -> None:
    """Close MLflow's assistant side panel where the loaded page shows it (MLflow 3.17 opens it on a
    new browser), as a person does to see the page."""
    close = pg.locator("[data-component-id='mlflow.assistant.chat_panel.close']")
    if close.is_visible():
        close.click()


@pytest.fixture(scope="module")
def variant_runs(home, instance, mlflow) -> dict[str, object]:
    """The compared pretrain_variants partitions (materialized from the CLI where the home lacks them):
    variant -> its newest MLflow run."""
    from dagster import AssetKey

    done = instance.get_materialized_partitions(AssetKey("pretrain_variants"))
    run_config = {"ops": {"pretrain_variants": {"config": {"overrides": {"budget.steps": str(VARIANT_STEPS)}}}}}
    for variant in [v for v in COMPARED if v not in done]:
        run_cli(materialize("pretrain_variants", "--partition", variant, config=run_config), home)
    client, exp = mlflow
    runs = {}
    for variant in COMPARED:
        found = client.search_runs([exp], f"tags.`ghostvis.variant` = '{variant}'", order_by=["start_time DESC"])
        assert found, f"no MLflow run of pretrain variant {variant}"
        runs[variant] = found[0]
    return runs


def test_mlflow_compares_the_two_pretrain_variants(page, mlflow_url, mlflow, variant_runs):
    client, exp = mlflow
    runs = [variant_runs[v] for v in COMPARED]
    names = [r.info.run_name for r in runs]
    differing = {k for k in runs[0].data.params if runs[0].data.params[k] != runs[1].data.params.get(k)}
    assert differing == {"run_key", *VARIANTS["pretrain"][COMPARED[0]]}, differing  # optim.lr, and the runs' keys

    # the run list (training runs view): tick the two variants, Compare
    page.goto(f"{mlflow_url}/#/experiments/{exp}/runs?workflowType=machine_learning")
    for name in names:
        row = page.get_by_role("row").filter(has=page.get_by_role("link", name=name, exact=True)).first
        row.get_by_role("checkbox", name=re.compile("toggle row selection")).check()
    close_assistant(page)
    step("10-mlflow-select-variants", page)
    page.locator("button", has_text=re.compile(r"^Compare")).first.click()
    page.get_by_text("optim.lr", exact=True).first.wait_for()
    run_row = page.locator("tr", has=page.locator("th", has_text=re.compile(r"^Run Name:?$"))).first
    columns = [c.strip() for c in run_row.locator("td").all_inner_texts()]
    lr_row = page.locator("tr", has=page.locator("th, td", has_text=re.compile(r"^optim\.lr$"))).first
    lr_shown = [c.strip() for c in lr_row.locator("td").all_inner_texts()][-len(columns) :]
    lr_row.scroll_into_view_if_needed()
    step("11-mlflow-compare-params", page)
    by_name = {r.info.run_name: r for r in runs}
    assert sorted(columns) == sorted(names), columns
    assert lr_shown == [by_name[c].data.params["optim.lr"] for c in columns], lr_shown

    # their loss curves on one chart: each curve is the run's logged train/loss
    ids = [r.info.run_id for r in runs]
    params = (
        f"?runs={json.dumps(ids)}&metric={urllib.parse.quote(json.dumps('train/loss'))}"
        f"&experiments={json.dumps([exp])}&plot_metric_keys={urllib.parse.quote(json.dumps(['train/loss']))}"
        "&plot_layout={}&x_axis=step&y_axis_scale=linear&line_smoothness=1&show_point=true"
        "&deselected_curves=[]&last_linear_y_axis_range=[]"
    )
    page.goto(f"{mlflow_url}/#/metric{params}")
    page.get_by_text("2/2", exact=True).wait_for()  # "Completed Runs 2/2": both histories loaded
    chart = page.locator(".js-plotly-plot").first
    chart.wait_for()
    curves = eventually(
        lambda: chart.evaluate(
            "e => (e.data || []).map(t => ({name: t.name, x: Array.from(t.x), y: Array.from(t.y)}))"
        ),
        lambda c: {t["name"] for t in c} == set(names),
    )
    close_assistant(page)
    step("12-mlflow-loss-curves", page)
    assert {c["name"] for c in curves} == set(names), curves
    for curve in curves:  # (plotly draws a run's line and its points as two traces)
        history = sorted(
            (m.step, m.value) for m in client.get_metric_history(by_name[curve["name"]].info.run_id, "train/loss")
        )
        assert len(history) >= 2 and curve["x"] == [s for s, _ in history], (curve, history)
        assert curve["y"] == pytest.approx([v for _, v in history]), (curve, history)


def test_mlflow_experiment_opens_on_the_training_runs(
    page, browser, mlflow_url, mlflow, variant_runs, monkeypatch, request
):
    """A fresh browser (no stored view choice) following the link GhostVis gives lands on the training
    runs, not on GenAI traces. MLflow's UI (3.17 and 3.18) ignores the experiment's `mlflow.experimentKind`
    tag: it takes the view from the URL's `workflowType` parameter, else from the browser's last choice
    (localStorage `mlflow.workflowType`), GenAI by default, and neither the server nor the experiment
    can change that. So GhostVis's links carry `workflowType=machine_learning`, and the bare experiment
    URL (also what MLflow's experiment list links to) still opens the GenAI overview, asserted by the
    address MLflow rewrites it to (its overview's text differs between releases): an MLflow that honours
    the tag fails here, and the parameter can go."""
    from ghostvis_pipeline.assets import training

    _, exp = mlflow
    run = variant_runs[COMPARED[0]]
    monkeypatch.setenv("GHOSTVIS_MLFLOW_UI", mlflow_url)  # the server the run links of Dagster's metadata open
    page.goto(training.mlflow_url(exp, run.info.run_id))
    page.get_by_role("heading", name=run.info.run_name).first.wait_for()
    # the side bar's link to the experiment's runs, in the view the run page opened on
    page.locator(f'a[href="#/experiments/{exp}/runs?workflowType=machine_learning"]').first.click()
    page.get_by_role("link", name=run.info.run_name, exact=True).first.wait_for()
    close_assistant(page)
    step("13-mlflow-experiment", page)
    landed = page.evaluate("location.hash")
    assert landed.startswith(f"#/experiments/{exp}/runs?workflowType=machine_learning"), landed

    with captured_page(browser, request, *VIEWPORT, name="mlflow_bare_experiment") as bare:
        bare.goto(f"{mlflow_url}/#/experiments/{exp}")
        expect(bare).to_have_url(re.compile(rf"#/experiments/{exp}/overview\?workflowType=genai"))
        expect(bare.get_by_role("link", name=run.info.run_name, exact=True)).to_have_count(0)


# ---------------------------------------------------------------------------------- 2. backfill


def write_source(folder: Path, shards: int = 2, docs: int = 60) -> None:
    """A text source of the FineWeb-Edu schema (a `text` column): generated word sequences, so no
    document repeats one of the demo's."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    words = (
        "lantern river copper meadow signal harbor orbit pencil canyon velvet quartz ember willow compass "
        "glacier thistle beacon marble falcon saddle prism cobalt tundra"
    ).split()
    rng = random.Random(27)
    folder.mkdir(parents=True)
    for shard in range(shards):
        texts = [" ".join(rng.choice(words) for _ in range(rng.randint(40, 120))) + "." for _ in range(docs)]
        pq.write_table(pa.table({"text": texts}), folder / f"{shard:05d}.parquet")


def pick_partitions(pg, dialog, keys: list[str]) -> None:
    """Custom selection in the partitions dialog: type each key, tick it."""
    dialog.get_by_text("Select a partition or create one").click()
    for key in keys:
        tick_partition(pg, key)
    pg.keyboard.press("Escape")
    dialog.get_by_text(f"{len(keys)} partitions", exact=True).wait_for()


def tick_partition(pg, key: str) -> None:
    """Type `key` into the open partition picker and click its row in the picker's menu. The menu, not the
    page: the asset page behind the dialog can show the same key (its latest materialization), and in CI
    (stop 51) the first visible match was that text, under the dialog's "Missing" button, so no click landed."""
    pg.keyboard.press("Control+A")
    pg.keyboard.type(key)
    pg.get_by_role("menu").get_by_text(key, exact=True).filter(visible=True).click()


def add_source(home: Path, instance, folder: Path) -> tuple[list[str], list[str]]:
    """From the CLI, as "Your own data" does: register a new source (shard_manifest with it under
    `remote:`) and download its shards (raw_shards). The shard partitions before, and the new ones."""
    from ghostvis_pipeline.partitions import shard_partitions

    registered = instance.get_dynamic_partitions(shard_partitions.name)
    write_source(folder)
    source = {"name": NEW_SOURCE, "listing": folder.as_uri()}
    materialize = ["dagster", "asset", "materialize", "-m", "ghostvis_pipeline.definitions", "--select"]
    run_cli(
        [
            *materialize,
            "shard_manifest",
            "--config-json",
            json.dumps({"ops": {"shard_manifest": {"config": {"remote": [source]}}}}),
        ],
        home,
    )
    keys = instance.get_dynamic_partitions(shard_partitions.name)
    new = keys[len(registered) :]
    assert keys[: len(registered)] == registered and new == [f"{NEW_SOURCE}/00000", f"{NEW_SOURCE}/00001"], keys
    run_cli([*materialize, "raw_shards", "--partition-range", f"{new[0]}...{new[-1]}"], home)
    return registered, new


def launch_backfill(pg, dagster_url: str, partitions: list[str]) -> str:
    """tokenized_shards' Materialize… dialog: the partitions picked, Launch backfill, the toast's View.
    The backfill's id, from its page's URL."""
    pg.goto(f"{dagster_url}/assets/tokenized_shards")
    pg.locator("button", has_text=re.compile(r"^Materialize")).first.click()
    dialog = pg.get_by_role("dialog")
    pick_partitions(pg, dialog, partitions)
    step("14-backfill-dialog", pg)
    dialog.locator("button", has_text=re.compile(r"^Launch backfill$")).click()
    pg.get_by_text("Created backfill").wait_for()
    pg.get_by_role("link", name="View", exact=True).click()
    pg.wait_for_url(re.compile(r"/runs/b/"))
    return pg.url.split("/runs/b/", 1)[1].split("?", 1)[0]


def test_backfill_from_the_partitions_dialog_tokenizes_a_new_sources_shards(
    page, home, dagster_url, instance, tmp_path
):
    from dagster import AssetKey, RunsFilter

    registered, new = add_source(home, instance, tmp_path / NEW_SOURCE)
    keys = [*registered, *new]
    ledger_before = {r["shard_id"] for r in cli_json(home, "ledger")["shards"]}
    chosen = [registered[-1], *new]  # the range from the last shard already tokenized through the new ones
    backfill_id = launch_backfill(page, dagster_url, chosen)
    backfill = eventually(
        lambda: instance.get_backfill(backfill_id), lambda b: b.status.value in BACKFILL_ENDED, RUN_TIMEOUT_S, 2
    )
    assert backfill.status.value in ("COMPLETED", "COMPLETED_SUCCESS"), backfill.status
    (run,) = instance.get_runs(filters=RunsFilter.for_backfill(backfill_id))
    assert run.status.value == "SUCCESS"
    assert sorted(instance.get_materialized_partitions(AssetKey("tokenized_shards"))) == sorted(keys)

    shards = {r["shard_id"]: r for r in cli_json(home, "ledger")["shards"]}
    assert set(shards) - ledger_before == set(new)  # exactly the new source's rows
    assert all(shards[k]["tokens"] > 0 and shards[k]["split"] == "train" for k in new), [shards[k] for k in new]

    # what the UI shows: the backfill succeeded, all its partitions (targeted, in progress, succeeded,
    # failed), and every partition of the asset materialized
    page.goto(f"{dagster_url}/runs/b/{backfill_id}")
    page.get_by_text("100% completed", exact=True).wait_for()
    n = len(chosen)
    assert re.search(
        rf"Status\nSucceeded\n.*\ntokenized_shards\n100% completed\n{n}\n0\n{n}\n0(\n|$)", page.inner_text("body"), re.S
    ), page.inner_text("body")
    page.goto(f"{dagster_url}/assets/tokenized_shards?view=partitions")
    page.get_by_text(f"Materialized ({len(keys)})", exact=True).wait_for()
    page.get_by_text("Missing (0)", exact=True).wait_for()
    page.get_by_placeholder("Filter by name").fill(NEW_SOURCE)
    for key in new:
        page.get_by_text(key, exact=True).filter(visible=True).first.wait_for()
    step("15-partitions-materialized", page)

"""The lineage quality gate (ghostvis_core/verify/eval/quality_gate.py): each stage's held-out bits per byte against
its upstream's, judged on hand-built figures, in the report card, and on the smoke demo's evaluation."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ghostvis_core.counts import TokenCounts
from ghostvis_core.data.ledger.records import RunTotals, Segment
from ghostvis_core.errors import GhostvisError
from ghostvis_core.plan.stages import BPB_TOLERANCE, stage_names
from ghostvis_core.verify.eval.quality_gate import lineage_gate, tolerances
from ghostvis_core.verify.eval.report_card import StageReport, tables

# pretrain -> continued_pretrain: prose 12% worse (flagged), code 9% worse (within 10%)
BPB = {"pretrain": {"demo_prose": 2.5, "demo_code": 3.0}, "continued_pretrain": {"demo_prose": 2.8, "demo_code": 3.27}}


def test_a_stage_12_percent_worse_is_flagged_and_9_percent_passes_with_both_sides_shown():
    out = lineage_gate(BPB, tolerances())
    assert not out.passed
    header, rows = out.table()
    by_source = {r[2]: dict(zip(header, r)) for r in rows}
    assert by_source["demo_prose"] == {
        "stage": "continued_pretrain",
        "upstream": "pretrain",
        "source": "demo_prose",
        "upstream bpb": 2.5,
        "stage bpb": 2.8,
        "ratio": 1.12,
        "tolerance": 0.1,
        "status": "FLAGGED: +12.0% > 10%",
    }
    assert by_source["demo_code"]["ratio"] == 1.09 and by_source["demo_code"]["status"] == "ok"
    assert out.figures == {
        "compared": 2,
        "flagged": 1,
        "stages_flagged": "continued_pretrain",
        "worst": "continued_pretrain on demo_prose",
        "worst_ratio": 1.12,
        "worst_tolerance": 0.1,
    }
    assert len(out.failures) == 1 and out.failures[0].startswith(
        "continued_pretrain: demo_prose bpb 2.800 is +12.0% against pretrain's 2.500, beyond its tolerance of 10%"
    )


def test_a_raised_tolerance_passes_the_same_figures_and_pretrain_has_nothing_to_compare():
    assert lineage_gate(BPB, tolerances({"continued_pretrain": 0.15})).passed
    only_pretrain = lineage_gate({"pretrain": BPB["pretrain"]}, tolerances())
    assert only_pretrain.passed and only_pretrain.figures["compared"] == 0


def test_tolerances_default_from_the_stage_table_and_refuse_unknown_stages_and_negatives():
    assert BPB_TOLERANCE == 0.10
    assert tolerances() == {s: 0.10 for s in stage_names()}
    assert tolerances({"dpo": 0.25})["dpo"] == 0.25 and tolerances({"dpo": 0.25})["sft"] == 0.10
    with pytest.raises(GhostvisError, match="unknown stage.*sfft"):
        tolerances({"sfft": 0.2})
    with pytest.raises(GhostvisError, match="cannot be negative"):
        tolerances({"sft": -0.1})


def stage_card(stage: str, **fields) -> StageReport:
    """A report card's stage with nothing but what a test gives (and the BPB scores above, where they have it)."""
    return StageReport(
        **{
            "stage": stage,
            "run_key": f"{stage}-r1",
            "mlflow_run_id": "x",
            "totals": RunTotals(TokenCounts(), overlap_tokens=0, steps=1, segments=(0,), parts=1),
            "planned_tokens": 0,
            "shards_used": 0,
            "shard_rows": [],
            "reuse": "none",
            "leakage": "none",
            "wall_time_s": 1.0,
            "tokens_per_sec": 1.0,
            "mfu": None,
            "attention_kernel": "sdpa-per-document",
            "val_loss_start": None,
            "val_loss": None,
            "evidence": [],
            "costs": [],
            "evaluation": {"bpb": BPB[stage]} if stage in BPB else {},
            "bpb_tolerance": 0.10,
            **fields,
        }
    )


def test_the_report_card_lists_the_gate_row_per_stage_and_source_and_flags_the_regression():
    header, rows = tables([stage_card("pretrain"), stage_card("continued_pretrain")])[
        "Lineage quality gate (held-out bits/byte vs the upstream stage)"
    ]
    assert [(r[2], r[3], r[4], r[7]) for r in rows] == [
        ("demo_code", 3.0, 3.27, "ok"),
        ("demo_prose", 2.5, 2.8, "FLAGGED: +12.0% > 10%"),
    ]


def test_the_report_card_links_each_segments_step_range_to_ghostvis_trace():
    """Per stage and segment (launch): its steps and the `ghostvis trace` command and trace job config that
    list what a step of them fed, so a loss spike leads to its documents (issue 43)."""
    segments = [
        Segment(0, first_step=1, world_size=2, real_tokens=1, last_step=40),
        Segment(1, first_step=41, world_size=4, real_tokens=1, last_step=60),
    ]
    header, rows = tables([stage_card("pretrain", segments=segments)])["Step ranges: the documents a step fed"]
    assert header[:3] == ["stage", "segment", "steps"]
    assert [r[:4] for r in rows] == [
        ["pretrain", 0, "1-40", "ghostvis trace --stage pretrain --run-key pretrain-r1 --step 1"],
        ["pretrain", 1, "41-60", "ghostvis trace --stage pretrain --run-key pretrain-r1 --step 41"],
    ]
    config = json.loads(rows[1][4].split("config ", 1)[1])
    assert config == {"stage": "pretrain", "step": 41, "run_key": "pretrain-r1"}
    # report.json holds the totals flat and the segments as objects, as before they were typed
    row = json.loads(json.dumps(stage_card("pretrain", segments=segments[:1]).as_json()))
    assert row["totals"] == {
        "real_tokens": 0,
        "pad_tokens": 0,
        "loss_tokens": 0,
        "cropped_tokens": 0,
        "overlap_tokens": 0,
        "steps": 1,
        "segments": [0],
        "parts": 1,
    }
    assert row["segments"] == [{"segment": 0, "first_step": 1, "world_size": 2, "real_tokens": 1, "last_step": 40}]


@pytest.mark.e2e
def test_the_smoke_demo_passes_its_own_gate(demo_home):
    """The smoke demo's evaluation: every stage within 10% of its upstream on every held-out source, and
    the Dagster check recorded that verdict."""
    from dagster import AssetCheckKey, AssetKey, DagsterInstance

    os.environ["DAGSTER_HOME"] = str(demo_home / "dagster")
    instance = DagsterInstance.get()
    md = instance.get_latest_materialization_event(AssetKey("evaluation")).asset_materialization.metadata
    results = json.loads(Path(md["results"].value).read_text())
    out = lineage_gate({s: r["bpb"] for s, r in results.items()}, dict(md["bpb_tolerance"].value))
    assert out.passed, out.failures
    assert out.figures["compared"] == 2 * (len(stage_names()) - 1)  # every stage but pretrain, prose and code
    assert 0.9 < out.figures["worst_ratio"] <= 1.10
    check = instance.event_log_storage.get_asset_check_execution_history(
        AssetCheckKey(AssetKey("evaluation"), "lineage_quality_gate"), limit=1
    )[0]
    assert check.status.value == "SUCCEEDED"
    evaluated = check.event.dagster_event.event_specific_data
    assert evaluated.passed and evaluated.metadata["worst_ratio"].value == out.figures["worst_ratio"]

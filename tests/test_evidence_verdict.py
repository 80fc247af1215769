"""The report card says per stage whether its evidence improved: each before/after figure judged by the way it
should move, and a stage whose figures stayed flat shown as not improved, with the preset's reason."""

from __future__ import annotations

from ghostvis_core.plan.presets import evidence_note
from ghostvis_core.verify.eval.report import StageReport, render_markdown, tables
from ghostvis_core.verify.eval.verdict import improved
from tests.test_quality_gate import stage_card


def report(stage: str, evidence: list, note: str = "") -> StageReport:
    return stage_card(stage, evidence=evidence, evidence_note=note)


def test_each_figure_is_judged_by_the_way_it_should_move():
    assert improved("reward", 0.02, 0.31) and not improved("reward", 0.0, 0.0)
    assert improved("format_rate", 1.0, 1.0)  # kept at its best: it cannot rise
    assert improved("answer_loss", 2.1, 1.7) and not improved("answer_loss", 1.7, 1.7)
    assert improved("role_leak_rate", 0.0, 0.0) and not improved("role_leak_rate", 0.0, 0.1)
    assert improved("caption_loss_shuffled_image", 3.0, 2.0) is None  # context for the gap, no direction
    assert improved("reward", None, 0.3) is None and improved("generated_tokens", None, 1200) is None


def test_the_report_says_per_stage_whether_its_evidence_improved_and_why_not():
    stages = [
        report("rl", [("reward", 0.02, 0.31), ("format_rate", 0.1, 0.9), ("generated_tokens", None, 1200)]),
        report("dpo", [("preference_accuracy", 0.5, 0.5)], note="too few steps on 2 cores"),
        report("pretrain", []),
        report("sft", [("eot_rate", 0.9, 0.8)]),
        report("reasoning_mix", [("answer_accuracy", 0.1, 0.2)], note="never shown: it improved"),
    ]
    head, rows = tables(stages)["Did each stage's evidence improve?"]
    assert head == ["stage", "improved", "not improved", "why not"]
    assert rows == [
        ["rl", "yes", "-", "-"],
        ["dpo", "NO", "preference_accuracy", "too few steps on 2 cores"],
        ["pretrain", "-", "-", "-"],
        ["sft", "NO", "eot_rate", "not known"],
        ["reasoning_mix", "yes", "-", "-"],
    ]
    _, figures = tables(stages)["Evidence (held-out, before vs after)"]
    assert [r[-1] for r in figures] == ["yes", "yes", "-", "NO", "NO", "yes"]
    assert "| dpo | NO | preference_accuracy | too few steps on 2 cores |" in render_markdown("t", stages, "c.png", {})


def test_a_preset_names_why_a_stage_cannot_improve_and_is_silent_otherwise():
    assert "few steps" in evidence_note("rl", "smoke")
    assert "2 cores" in evidence_note("context_expansion", "tiny") and evidence_note("sft", "tiny") == ""
    assert "not arithmetic" in evidence_note("rl", "tiny")  # the answer line is learned, exact answers barely move
    assert evidence_note("rl", "500m") == ""

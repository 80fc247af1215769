"""The report card says per stage whether its evidence improved: each before/after figure judged by the way it
should move, and a stage whose figures stayed flat shown as not improved, with the preset's reason."""

from __future__ import annotations

from ghostvis_core.plan.presets import evidence_note
from ghostvis_core.verify.eval.figure_direction import improved
from ghostvis_core.verify.eval.report_card import StageReport, render_markdown, tables
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
    assert evidence_note("context_expansion", "tiny") == evidence_note("sft", "tiny") == ""  # both move their way
    assert "a seed can leave them flat" in evidence_note("rl", "tiny")  # exact answers rise by a few samples
    assert evidence_note("rl", "500m") == ""


def test_the_report_says_whether_the_seed_benchmark_shows_a_flat_figure_as_seed_noise(tmp_path):
    """The seed benchmark's result kept in the store (benchmarks/seeds.py): a figure that moved its way on 4 of 5
    seeds is flat by seed noise on this one; one that moved on 1 of 5 is the recipe's."""
    from ghostvis_core.store import FolderStore
    from ghostvis_core.verify.eval.seeds import read_seed_moves, seed_result, seeds_name

    ctx = [["loss_within_context", 6.0, 6.1]]  # context, no direction: never counted
    runs = {
        seed: {
            "context_expansion": [["loss_beyond_context", 6.0, 6.1 if seed > 1337 else 5.9], *ctx],
            "rl": [["reward", 0.0, 0.1 if seed < 1341 else 0.0], ["format_rate", 0.0, 1.0]],
        }
        for seed in range(1337, 1342)
    }
    store = FolderStore(tmp_path)
    assert read_seed_moves(store, "smoke") == {}
    store.write_json("report", seeds_name("smoke"), data=seed_result("smoke", runs, dict.fromkeys(runs, 1.01), 60.0))
    moves = read_seed_moves(store, "smoke")
    assert moves == {
        "context_expansion": {"loss_beyond_context": [1, 5]},
        "rl": {"reward": [4, 5], "format_rate": [5, 5]},
    }
    stages = [
        stage_card(
            "context_expansion", evidence=[("loss_beyond_context", 6.0, 6.1)], seed_moves=moves["context_expansion"]
        ),
        stage_card(
            "rl",
            evidence=[("reward", 0.0, 0.0), ("format_rate", 0.0, 1.0)],
            seed_moves=moves["rl"],
            evidence_note="few steps",
        ),
        stage_card("sft", evidence=[("eot_rate", 0.0, 0.0)]),
    ]
    _, rows = tables(stages)["Did each stage's evidence improve?"]
    assert rows == [
        [
            "context_expansion",
            "NO",
            "loss_beyond_context",
            "loss_beyond_context moved its way on 1/5 seeds (not seed noise: the recipe does not move it)",
        ],
        ["rl", "NO", "reward", "few steps; reward moved its way on 4/5 seeds (seed noise)"],
        ["sft", "NO", "eot_rate", "not known"],
    ]


def test_the_report_tables_each_rl_steps_sampled_reward_figures():
    """TRL's GRPO figures per logged step, from the run's MLflow history (the stage's curves); none for a stage
    that samples nothing."""
    curves = {
        "train/loss": [(1, 0.3), (2, 0.2)],
        "rl/reward_mean": [(1, 0.0125), (2, 0.1)],
        "rl/reward_std": [(1, 0.025), (2, 0.0)],
        "rl/frac_reward_zero_std": [(1, 0.75), (2, 1.0)],
        "rl/exact_rate": [(1, 0.0), (2, 0.0)],
    }
    stages = [stage_card("sft", curves={"train/loss": [(1, 2.0)]}), stage_card("rl", curves=curves)]
    head, rows = tables(stages)["GRPO steps (sampled rewards, TRL's figures)"]
    assert head == [
        "stage",
        "step",
        "rl/reward_mean",
        "rl/reward_std",
        "rl/frac_reward_zero_std",
        "rl/exact_rate",
        "rl/kl",
    ]
    assert rows == [["rl", 1, 0.0125, 0.025, 0.75, 0.0, None], ["rl", 2, 0.1, 0.0, 1.0, 0.0, None]]  # no reference

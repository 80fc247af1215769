"""Evidence across data seeds: the result benchmarks/seeds.py keeps in a home (per preset: for each stage's
evidence figure, on how many of the seeds it moved the way its stage should move it, and the lineage gate's worst
ratio per seed), and the report card's reading of it for a figure that did not move: whether the seed benchmark
shows that as seed noise (the figure moves on most seeds) or as the recipe's (it does not)."""

from __future__ import annotations

from typing import Any

from ghostvis_core.store import Store
from ghostvis_core.verify.eval.figure_direction import improved

# The share of seeds on which a stage's evidence must move the right way: 4 of 5 (the seed benchmark's goal).
MOVES_ON_SHARE = 0.8


def seeds_name(preset: str) -> str:
    """The `report` name of a preset's seed benchmark result."""
    return f"seeds/{preset}.json"


def figure_moves(runs: dict[int, dict[str, list]]) -> dict[str, dict[str, list[int]]]:
    """stage -> figure -> [seeds on which it moved its way, seeds on which it has a direction], from each seed's
    report card figures (seed -> stage -> [[figure, before, after], ...])."""
    out: dict[str, dict[str, list[int]]] = {}
    for figures in runs.values():
        for stage, rows in figures.items():
            for name, before, after in rows:
                verdict = improved(name, before, after)
                if verdict is not None:
                    moved = out.setdefault(stage, {}).setdefault(name, [0, 0])
                    moved[0] += int(verdict)
                    moved[1] += 1
    return out


def read_seed_moves(store: Store, preset: str) -> dict[str, dict[str, list[int]]]:
    """The preset's seed benchmark result in this store (figure_moves' form), {} when none was kept."""
    name = seeds_name(preset)
    return figure_moves(store.read_json("report", name)["runs"]) if store.exists("report", name) else {}


def seed_note(moves: dict[str, list[int]], flat: list[str]) -> str:
    """Why the stage's flat figures did not move, by the seed benchmark ('' without one): for each, on how many
    seeds it moved, and whether that makes this run's flat figure seed noise or the recipe's."""
    notes = []
    for name in flat:
        if name not in moves:
            continue
        k, n = moves[name]
        why = "seed noise" if k >= MOVES_ON_SHARE * n else "not seed noise: the recipe does not move it"
        notes.append(f"{name} moved its way on {k}/{n} seeds ({why})")
    return "; ".join(notes)


def seed_result(preset: str, runs: dict[int, dict[str, list]], gate: dict[int, float], wall_s: float) -> dict[str, Any]:
    """The result kept for the report card: each seed's evidence figures and gate worst ratio."""
    return {"preset": preset, "runs": runs, "gate_worst_ratio": gate, "wall_s": wall_s}

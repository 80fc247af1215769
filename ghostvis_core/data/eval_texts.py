"""The text of the evaluation items GhostVis ships: the fixed prompts every stage is sampled with, the
multiple-choice benchmark's templated items and the folder of its lm-evaluation-harness tasks. One place
for the evaluation (ghostvis_core/verify/eval), the decontamination gate (ghostvis_core/verify/audit/contamination.py)
and the demo builders that keep their training data clear of these items (ghostvis_core/data/decontaminate.py),
none of which may import the evaluation code (it loads models and the training stack).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from ghostvis_core.data.fact_tables import capitals

PROMPTS = (
    "The tallest mountain in the world is",
    "def fibonacci(n):",
    "The capital of France is",
    "3 + 4 =",
)

LM_EVAL_TASKS_DIR = Path(__file__).resolve().parents[1] / "resources" / "lm_eval_tasks"
BENCHMARK_SEED, BENCHMARK_PER_TASK = (
    7,
    40,
)  # the benchmark's defaults (ghostvis_core/verify/eval/benchmark.py build_items)


def template_choices(rng: random.Random, per_task: int) -> list[tuple[str, str, list[str], int]]:
    """The templated items (arithmetic, capitals) as text, (task, context, options, answer): what
    build_items encodes and what the decontamination gate (ghostvis_core/verify/audit/contamination.py) hashes."""
    items = []
    for _ in range(per_task):
        a, b = rng.randint(2, 40), rng.randint(2, 40)
        right = a + b
        wrong = rng.sample([v for v in range(right - 6, right + 7) if v not in (right,) and v > 0], 3)
        opts = [right, *wrong]
        rng.shuffle(opts)
        items.append(("arithmetic", f"Step 1: {a} + {b} =", [f" {v}." for v in opts], opts.index(right)))
    caps = capitals()
    for country, city in rng.sample(list(caps), min(per_task, len(caps))):
        others = rng.sample([c for _, c in caps if c != city], 3)
        names = [city, *others]
        rng.shuffle(names)
        items.append(("capitals", f"The capital of {country} is", [f" {c}." for c in names], names.index(city)))
    return items


def item_text(record: dict[str, Any]) -> str:
    """An evaluation item's text: its string fields in order, plus choices[answer] for a
    multiple-choice item (the question and its right answer are what a leaked copy holds)."""
    parts = [v for v in record.values() if isinstance(v, str)]
    choices, answer = record.get("choices"), record.get("answer")
    if isinstance(choices, list) and isinstance(answer, int) and 0 <= answer < len(choices):
        parts.append(str(choices[answer]))
    return "\n".join(parts)


def shipped_texts() -> list[str]:
    """The text of every evaluation item GhostVis ships, as the gate hashes it: each line of the
    lm-eval tasks, each benchmark item (context + right answer), each prompt. The demo builders keep
    their training documents clear of these (ghostvis_core/data/decontaminate.py)."""
    texts = []
    for path in sorted(LM_EVAL_TASKS_DIR.rglob("*.jsonl")):
        records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        texts += [item_text(r) if isinstance(r, dict) else str(r) for r in records]
    choices = template_choices(random.Random(BENCHMARK_SEED), BENCHMARK_PER_TASK)
    texts += [context + options[answer] for _, context, options, answer in choices]
    return texts + list(PROMPTS)

"""The report card's goodput chart: per stage, one horizontal bar of its run's wall time stacked by category
(ghostvis_core/data/ledger/goodput.py), so where each stage's time went is seen side by side."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ghostvis_core.data.ledger.goodput import CATEGORIES

GOODPUT_CHART = "goodput.png"  # beside the report's files


def goodput_chart(breakdowns: dict[str, dict[str, Any]], path: Path) -> Path:
    """`breakdowns`: stage -> `Goodput.as_dict()`; the bar's segments are each category's seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = list(breakdowns)
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(stages) + 1.6))
    left = [0.0] * len(stages)
    for category in CATEGORIES:
        widths = [breakdowns[s]["seconds"][category] for s in stages]
        ax.barh(stages, widths, left=left, label=category)
        left = [a + b for a, b in zip(left, widths)]
    for y, s in enumerate(stages):
        ax.text(left[y], y, f" goodput {breakdowns[s]['goodput']:.0%}", va="center", fontsize=8)
    ax.set_xlabel("wall seconds")
    ax.invert_yaxis()
    ax.legend(fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path

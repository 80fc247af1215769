"""The report card of a lineage: one HTML page (and its Markdown twin) with each stage's planned vs
consumed tokens, shards used, reuse and leakage status, loss curves, evidence, mixture vs recipe, evaluation, the
replay verdict (K checkpoint intervals re-executed and compared bit for bit, verify/replay), the
lineage quality gate (held-out bpb vs the upstream stage, ghostvis_core/verify/eval/quality_gate.py), wall time and
throughput, what the same plan would cost on GPUs, and each stage's step ranges with the `ghostvis trace`
command (and the Dagster `trace` job's config) that lists the documents a step fed, so a loss spike
leads to its documents. Token figures and step ranges come from the ledger.
"""

from __future__ import annotations

import html
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ghostvis_core.counts import GRPO_STEP_METRICS
from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.ledger.goodput import CATEGORIES, ledger_goodput
from ghostvis_core.data.ledger.query import UNDECLARED_KINDS, Reuse
from ghostvis_core.data.ledger.records import RunTotals, Segment, ShardConsumption
from ghostvis_core.plan.budget import StepTime, plan
from ghostvis_core.plan.config import StageConfig
from ghostvis_core.plan.presets import evidence_note
from ghostvis_core.runs.run_result import RunResult
from ghostvis_core.store import Store
from ghostvis_core.store.files import atomic_write
from ghostvis_core.verify.eval.figure_direction import improved
from ghostvis_core.verify.eval.goodput_chart import GOODPUT_CHART, goodput_chart
from ghostvis_core.verify.eval.quality_gate import GATE_HEADER, gate_rows
from ghostvis_core.verify.eval.seeds import seed_note


@dataclass
class StageReport:
    stage: str
    run_key: str
    mlflow_run_id: str
    totals: RunTotals
    planned_tokens: int
    shards_used: int
    shard_rows: list[ShardConsumption]
    reuse: str
    leakage: str
    wall_time_s: float
    tokens_per_sec: float
    mfu: float | None
    attention_kernel: str
    val_loss_start: float | None
    val_loss: float | None
    evidence: list[tuple[str, Any, Any]]
    costs: list[dict[str, Any]]
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    evaluation: dict[str, Any] = field(default_factory=dict)
    mixture: dict[str, dict[str, Any]] = field(default_factory=dict)  # source -> fraction, weight, tokens
    bpb_tolerance: float | None = None  # the quality gate's allowed bpb worsening vs upstream
    segments: list[Segment] = field(default_factory=list)  # Ledger.segments: each launch's step range
    evidence_note: str = ""  # why the preset's run cannot improve the stage's evidence, where it cannot
    replay: str = ""  # the replay verdict (verify/replay/record.py): "2 intervals replayed, bitwise equal"
    # the seed benchmark's figure -> [seeds it moved its way on, seeds] for this stage (verify/eval/seeds.py)
    seed_moves: dict[str, list[int]] = field(default_factory=dict)
    goodput: dict[str, Any] = field(default_factory=dict)  # Goodput.as_dict() of the run ({}: no timeline)

    def as_json(self) -> dict[str, Any]:
        """The row as report.json holds it: the ledger's records as plain objects, the totals flat."""
        return {
            **self.__dict__,
            "totals": self.totals.as_dict(),
            "shard_rows": [asdict(r) for r in self.shard_rows],
            "segments": [asdict(g) for g in self.segments],
        }


def reuse_summary(reuse: list[Reuse]) -> str:
    """The report card's reuse cell: FLAGGED with the undeclared tokens read twice, else none, with the
    declared tokens by reason."""
    bad = sum(r.tokens for r in reuse if r.kind in UNDECLARED_KINDS)
    if bad:
        return f"FLAGGED: {bad:,} tokens read twice"
    retrained = sum(r.tokens for r in reuse if r.kind == "retrained_after_fallback")
    declared = sum(r.tokens for r in reuse) - retrained
    notes = [f"{declared:,} tokens of declared replay/repeat"] if declared else []
    notes += [f"{retrained:,} tokens retrained after a damaged checkpoint"] if retrained else []
    return "none" + (f" ({'; '.join(notes)})" if notes else "")


def stage_report(
    ledger: Ledger,
    result: RunResult,
    config: StageConfig,
    curves: dict[str, list],
    evaluation: dict[str, Any],
    gpu_prices: dict[str, float],
    bpb_tolerance: float,
    replay: str = "",
) -> StageReport:
    """One stage's row of the report, from its run record, config, the ledger and its evaluation
    (judged by the quality gate with `bpb_tolerance`), and its replay verdict."""
    key = result.run_key
    totals = ledger.run_totals(key)
    shards = ledger.consumed_by_shard(key)
    reuse_text = reuse_summary(ledger.reuse(key))
    leaked = ledger.leakage(key)
    leak_text = f"FLAGGED: {', '.join(r.consumed.shard_id for r in leaked)}" if leaked else "none"
    evidence: list[tuple[str, Any, Any]] = [(name, e.before, e.after) for name, e in sorted(result.evidence.items())]
    if result.frozen is not None:
        evidence.append(("frozen_params_unchanged", None, result.frozen.unchanged))
    evidence += [(name, None, n) for name, n in result.generated.items()]  # rl: generated/rewarded tokens
    costs = []
    for gpu, price in gpu_prices.items():
        p = plan(config, step_time=StepTime(gpu=gpu), price_per_gpu_hour=price)
        costs.append({"gpu": gpu, "gpus": p.batch.world_size, "gpu_hours": p.gpu_hours, "cost": p.cost, "price": price})
    return StageReport(
        stage=result.stage,
        run_key=key,
        mlflow_run_id=result.mlflow_run_id,
        totals=totals,
        planned_tokens=int(result.planned_tokens),
        shards_used=len(shards),
        shard_rows=shards,
        reuse=reuse_text,
        leakage=leak_text,
        wall_time_s=float(result.wall_time_s),
        tokens_per_sec=float(result.tokens_per_sec),
        mfu=result.mfu,
        attention_kernel=result.attention_kernel or "-",
        val_loss_start=result.val_loss_start,
        val_loss=result.val_loss,
        evidence=evidence,
        costs=costs,
        curves=curves,
        evaluation=evaluation,
        mixture={s: asdict(m) for s, m in result.mixture.items()},
        bpb_tolerance=bpb_tolerance,
        segments=ledger.segments(key),
        evidence_note=evidence_note(result.stage, config.preset),
        replay=replay,
        goodput=g.as_dict() if (g := ledger_goodput(ledger, key)) else {},
    )


def loss_chart(stages: list[StageReport], path: Path) -> Path:
    """train/loss and val/loss of every stage, one panel each, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(stages)
    cols = min(4, n)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    for ax, st in zip(axes.flat, stages):
        for name, style in (("train/loss", "-"), ("val/loss", "o-")):
            pts = st.curves.get(name, [])
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=name, markersize=3)
        ax.set_title(st.stage)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:,.4g}"
    return str(v)


TOKEN_HEADER = [
    "stage",
    "run",
    "steps",
    "planned",
    "real",
    "pad",
    "loss",
    "cropped",
    "shards",
    "reuse",
    "leakage",
    "wall s",
    "tokens/s",
    "MFU",
    "attention",
    "val loss start",
    "val loss end",
]


def _token_row(s: StageReport) -> list[Any]:
    figures = s.totals.counts.as_list()
    return [
        s.stage,
        s.run_key,
        s.totals.steps,
        s.planned_tokens,
        *figures,
        s.shards_used,
        s.reuse,
        s.leakage,
        s.wall_time_s,
        s.tokens_per_sec,
        s.mfu,
        s.attention_kernel,
        s.val_loss_start,
        s.val_loss,
    ]


def _verdict(v: bool | None) -> str:
    return "-" if v is None else "yes" if v else "NO"


def evidence_verdict(s: StageReport) -> list[Any]:
    """[stage, whether every before/after evidence figure with a direction moved its way, the figures that did
    not, and why they cannot (the preset's note; 'not known' where it has none)]: a flat figure is never shown as a
    success."""
    judged = {name: improved(name, before, after) for name, before, after in s.evidence}
    judged = {name: v for name, v in judged.items() if v is not None}
    flat = sorted(name for name, v in judged.items() if not v)
    verdict = "-" if not judged else "NO" if flat else "yes"
    return [s.stage, verdict, ", ".join(flat) or "-", why_not(s, flat) if flat else "-"]


def why_not(s: StageReport, flat: list[str]) -> str:
    """Why the stage's flat figures did not move: the preset's note, then per figure what the seed benchmark
    found across seeds (seed noise or the recipe's); 'not known' with neither."""
    notes = [n for n in (s.evidence_note, seed_note(s.seed_moves, flat)) if n]
    return "; ".join(notes) or "not known"


def grpo_step_rows(s: StageReport) -> list[list[Any]]:
    """Per logged step of a stage that samples (rl): its sampled-reward figures under TRL's GRPO names, from the
    run's MLflow history (the report asset reads GRPO_STEP_METRICS into the stage's curves)."""
    values = {name: dict(s.curves.get(name, [])) for name in GRPO_STEP_METRICS}
    steps = sorted({step for by_step in values.values() for step in by_step})
    return [[s.stage, step, *(values[name].get(step) for name in GRPO_STEP_METRICS)] for step in steps]


def _evaluation_row(s: StageReport) -> list[Any]:
    bpb = ", ".join(f"{k} {v:.3f}" for k, v in s.evaluation.get("bpb", {}).items())
    return [s.stage, bpb, ", ".join(f"{k} {v:.2f}" for k, v in s.evaluation.get("mc", {}).items())]


def _harness_rows(stages: list[StageReport]) -> list[list[Any]]:
    harness = [(s.stage, s.evaluation.get("harness", {})) for s in stages]
    return [
        [stage, task, metric, value]
        for stage, tasks in harness
        for task, metrics in tasks.items()
        for metric, value in metrics.items()
    ]


def step_range_rows(s: StageReport) -> list[list[Any]]:
    """Per segment of the stage's run: its steps and how to list what any of them fed (`ghostvis trace`,
    or the Dagster `trace` job with that config), shown for the range's first step."""
    rows = []
    for seg in s.segments:
        first, last = seg.first_step, seg.last_step
        config = json.dumps({"stage": s.stage, "step": first, "run_key": s.run_key})
        rows.append(
            [
                s.stage,
                seg.segment,
                f"{first}-{last}",
                f"ghostvis trace --stage {s.stage} --run-key {s.run_key} --step {first}",
                f"trace job, op trace_ledger config {config}",
            ]
        )
    return rows


def tables(stages: list[StageReport]) -> dict[str, tuple[list[str], list[list[Any]]]]:
    """The report's tables, shared by the HTML and Markdown renderings."""
    bpb, tolerance = {s.stage: s.evaluation.get("bpb", {}) for s in stages}, {s.stage: s.bpb_tolerance for s in stages}
    return {
        "Tokens (ledger)": (TOKEN_HEADER, [_token_row(s) for s in stages]),
        "Evidence (held-out, before vs after)": (
            ["stage", "evidence", "before", "after", "improved"],
            [
                [s.stage, name, before, after, _verdict(improved(name, before, after))]
                for s in stages
                for name, before, after in s.evidence
            ],
        ),
        "Did each stage's evidence improve?": (
            ["stage", "improved", "not improved", "why not"],
            [evidence_verdict(s) for s in stages],
        ),
        "GRPO steps (sampled rewards, TRL's figures)": (
            ["stage", "step", *GRPO_STEP_METRICS],
            [r for s in stages for r in grpo_step_rows(s)],
        ),
        "Mixture (ledger vs recipe)": (
            ["stage", "source", "recipe weight", "fraction consumed", "tokens"],
            [[s.stage, src, m["weight"], m["fraction"], m["tokens"]] for s in stages for src, m in s.mixture.items()],
        ),
        "Evaluation": (
            ["stage", "bits/byte (per source)", "multiple choice (accuracy)"],
            [_evaluation_row(s) for s in stages],
        ),
        "Lineage quality gate (held-out bits/byte vs the upstream stage)": (
            GATE_HEADER,
            [r.cells() for r in gate_rows(bpb, tolerance)],
        ),
        "lm-evaluation-harness": (["stage", "task", "metric", "value"], _harness_rows(stages)),
        "Step ranges: the documents a step fed": (
            ["stage", "segment", "steps", "ghostvis trace (give any step of the range)", "in Dagster"],
            [r for s in stages for r in step_range_rows(s)],
        ),
        "Goodput (the run's wall seconds by category, from the ledger's timeline)": (
            ["stage", "run", "goodput", "wall s", *CATEGORIES],
            [
                [s.stage, s.run_key, s.goodput["goodput"], s.goodput["wall_s"], *s.goodput["seconds"].values()]
                for s in stages
                if s.goodput
            ],
        ),
        "Replay (sampled checkpoint intervals re-executed, compared bit for bit)": (
            ["stage", "run", "replay"],
            [[s.stage, s.run_key, s.replay or "-"] for s in stages],
        ),
        "The same plan on GPUs (40% MFU)": (
            ["stage", "gpu", "gpus", "GPU-hours", "price/h", "cost"],
            [[s.stage, c["gpu"], c["gpus"], c["gpu_hours"], c["price"], c["cost"]] for s in stages for c in s.costs],
        ),
    }


def render_markdown(title: str, stages: list[StageReport], chart: str, samples: dict[str, list]) -> str:
    out = [f"# {title}", "", f"![loss curves]({chart})", ""]
    out += [f"![goodput per stage]({GOODPUT_CHART})", ""] if any(s.goodput for s in stages) else []
    for name, (head, rows) in tables(stages).items():
        out += [f"## {name}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        out += ["| " + " | ".join(_fmt(v) for v in r) + " |" for r in rows]
        out.append("")
    out.append("## Samples")
    for stage, items in samples.items():
        out += ["", f"### {stage}"] + [f"- `{s['prompt']}` -> `{s['completion'].strip()}`" for s in items]
    return "\n".join(out) + "\n"


def render_html(title: str, stages: list[StageReport], chart: str, samples: dict[str, list]) -> str:
    e = html.escape
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title)}</title>",
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin-bottom:2em}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}th{background:#eee}"
        "td:first-child{text-align:left}.flag{color:#b00;font-weight:bold}</style></head><body>",
        f"<h1>{e(title)}</h1>",
        f"<img id='loss-curves' src='{e(chart)}' alt='loss curves'>",
    ]
    if any(s.goodput for s in stages):
        parts.append(f"<img id='goodput' src='{GOODPUT_CHART}' alt='goodput per stage, stacked by category'>")
    for name, (head, rows) in tables(stages).items():
        parts.append(f"<h2>{e(name)}</h2><table><tr>" + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr>")
        for r in rows:
            cells = "".join(
                f"<td{' class=flag' if 'FLAGGED' in _fmt(v) else ''} data-col='{e(h)}'>{e(_fmt(v))}</td>"
                for h, v in zip(head, r)
            )
            parts.append(f"<tr data-stage='{e(str(r[0]))}'>{cells}</tr>")
        parts.append("</table>")
    parts.append("<h2>Samples</h2>")
    for stage, items in samples.items():
        parts.append(
            f"<h3>{e(stage)}</h3><ul>"
            + "".join(
                f"<li><code>{e(s['prompt'])}</code> &rarr; <code>{e(s['completion'].strip())}</code></li>"
                for s in items
            )
            + "</ul>"
        )
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(
    store: Store, name: str, title: str, stages: list[StageReport], samples: dict[str, list]
) -> dict[str, Path]:
    """Write the report card under reports/<name>/ (kind "report") and publish it to every node; returns
    this machine's copies of its files (what MLflow logs)."""
    chart = loss_chart(stages, store.writable("report", f"{name}/loss_curves.png"))
    texts = {
        "html": render_html(title, stages, chart.name, samples),
        "md": render_markdown(title, stages, chart.name, samples),
        "json": json.dumps([s.as_json() for s in stages], indent=2, default=str),
    }
    files = {ext: atomic_write(store.writable("report", f"{name}/report.{ext}"), text) for ext, text in texts.items()}
    breakdowns = {s.stage: s.goodput for s in stages if s.goodput}
    if breakdowns:
        files["goodput_png"] = goodput_chart(breakdowns, store.writable("report", f"{name}/{GOODPUT_CHART}"))
    store.publish("report", name)
    return {**files, "png": chart}

"""Evidence across data seeds: does each stage's evidence move the right way on most seeds, or on the demo's
seed by luck?

Trains the preset's whole lineage (default smoke; --preset tiny) on N data seeds (default 5: the preset's own
data.seed and the N - 1 after it). The preset's own seed is the demo home's own lineage (--home: a home after
`ghostvis demo --preset P`, else one is built); every other seed trains in one copy of that home, every stage
with `data.seed=S` (`dagster asset materialize` of the stages, `evaluation` and `report`, their checks run), and
is read from its report card. Prints per stage each evidence figure before -> after on every seed, the share of
seeds on which it moved the way its stage should move it, and the lineage gate's worst ratio (held-out bpb vs the
upstream stage) per seed. Goals: every figure with a direction moves its way on >= 4 of 5 seeds; the gate holds
on every seed. The result is kept in the home given with --home (reports/seeds/<preset>.json), where the report
card reads it to say whether a flat figure is seed noise; a built home is removed with the scratch copy.

    .venv/bin/python benchmarks/seeds.py [--preset smoke|tiny] [--seeds 5] [--home PATH]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common as C  # noqa: E402

from ghostvis_core.home import Home  # noqa: E402
from ghostvis_core.plan import presets, selected  # noqa: E402
from ghostvis_core.plan.lineage import parse  # noqa: E402
from ghostvis_core.runs.lookup import newest_completed_run  # noqa: E402
from ghostvis_core.verify.eval.figure_direction import improved  # noqa: E402
from ghostvis_core.verify.eval.quality_gate import gate_rows  # noqa: E402
from ghostvis_core.verify.eval.seeds import MOVES_ON_SHARE, figure_moves, seed_result, seeds_name  # noqa: E402
from tests.conftest import cli_env, copy_home, materialize  # noqa: E402


def lineage_of(preset: str) -> list[str]:
    """The preset's lineage stages, in order (what `ghostvis demo --preset P` trains)."""
    return parse(selected.PRESET_LINEAGES.get(preset, selected.DEFAULT_LINEAGE)).stage_names()


def card(home: Path, last_stage: str) -> list[dict]:
    """The report card (report.json) of the home's newest lineage: named after its last stage's newest run."""
    store = Home(home).store
    newest = newest_completed_run(store, last_stage)
    if newest is None or not store.exists("report", f"{newest.run_key}/report.json"):
        raise C.BenchError(f"{home} has no report card of a completed {last_stage} run; run `ghostvis demo` there")
    return store.read_json("report", f"{newest.run_key}/report.json")


def figures(stages: list[dict]) -> dict[str, list]:
    """stage -> [[figure, before, after], ...] of the figures with a direction (the report card's evidence)."""
    return {
        s["stage"]: [[n, b, a] for n, b, a in s["evidence"] if improved(n, b, a) is not None]
        for s in stages
        if any(improved(n, b, a) is not None for n, b, a in s["evidence"])
    }


def gate_worst(stages: list[dict]) -> tuple[float, bool]:
    """The lineage gate on the card's evaluation: its worst ratio (stage bpb / upstream bpb) and whether every
    stage held its tolerance."""
    bpb = {s["stage"]: s["evaluation"].get("bpb", {}) for s in stages}
    rows = gate_rows(bpb, {s["stage"]: s["bpb_tolerance"] for s in stages})
    return max(r.ratio for r in rows), all(r.passed for r in rows)


def train_seed(home: Path, preset: str, stages: list[str], seed: int, log: Path, timeout: float) -> float:
    """Every stage with data.seed=seed, then evaluation and report, in one Dagster run: its wall time."""
    config = {"ops": {s: {"config": {"preset": preset, "overrides": {"data.seed": seed}}} for s in stages}}
    cmd = materialize(",".join([*stages, "evaluation", "report"]), config=config)
    env = cli_env(home)
    env["GHOSTVIS_PRESET"] = preset
    p = C.run_lines([str(C.ROOT / ".venv" / "bin" / cmd[0]), *cmd[1:]], env, log, timeout=timeout, check=False)
    if p.rc != 0:
        raise C.BenchError(f"seed {seed}: the lineage's materialization exited {p.rc}; log {log}:\n{C.tail(log)}")
    return p.wall


def moves_table(runs: dict[int, dict[str, list]]) -> tuple[list[list], list[str]]:
    """One row per stage and figure: before -> after on each seed, and on how many it moved its way."""
    moves, seeds, rows = figure_moves(runs), list(runs), []
    for stage, by_figure in moves.items():
        for name, (k, n) in by_figure.items():
            cells = []
            for s in seeds:
                fig = next((f for f in runs[s].get(stage, []) if f[0] == name), None)
                cells.append("-" if fig is None else f"{fig[1]:.3g}->{fig[2]:.3g}")
            rows.append([stage, name, *cells, f"{k}/{n}"])
    return rows, ["stage", "figure", *[f"seed {s}" for s in seeds], "moved"]


def report(runs: dict[int, dict[str, list]], gate: dict[int, tuple[float, bool]]) -> list[str]:
    """The table, the gate per seed and the goal lines."""
    rows, head = moves_table(runs)
    held = [[str(s), ratio, "yes" if ok else "NO"] for s, (ratio, ok) in gate.items()]
    out = [C.table(rows, head), "", C.table(held, ["seed", "gate worst ratio", "gate holds"]), ""]
    moves = figure_moves(runs)
    worst = min((k / n, f"{stage} {name}") for stage, m in moves.items() for name, (k, n) in m.items())
    out.append(C.goal(f"lowest share of seeds moved the right way ({worst[1]})", worst[0], MOVES_ON_SHARE))
    out.append(C.goal("seeds on which the lineage gate holds", sum(ok for _, ok in gate.values()), len(gate)))
    return out


def main() -> int:
    ap = C.arguments(__doc__, "a home after `ghostvis demo --preset P` (default: build one in a temp dir)")
    ap.add_argument("--preset", default="smoke")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=3600.0, help="per seed, seconds")
    args = ap.parse_args()
    stages = lineage_of(args.preset)
    base = presets.resolve(stages[0], args.preset).data.seed
    print(C.load_snapshot("before seeds"), flush=True)
    t0 = time.time()
    with C.work_folder("seeds", what=" (logs, the seeds' home)") as wd:
        home = Path(args.home).expanduser().resolve() if args.home else wd / "demo_home"
        if not args.home:
            C.build_demo_home(home, preset=args.preset, stages=tuple(stages), log=wd / "demo.log")
        first = card(home, stages[-1])
        runs, gate = {base: figures(first)}, {base: gate_worst(first)}
        scratch = copy_home(home, wd / "seeds_home")
        for seed in range(base + 1, base + args.seeds):
            wall = train_seed(scratch, args.preset, stages, seed, wd / f"seed-{seed}.log", args.timeout)
            stages_card = card(scratch, stages[-1])
            runs[seed], gate[seed] = figures(stages_card), gate_worst(stages_card)
            print(f"seed {seed}: lineage trained, evaluated and reported in {wall:.0f}s", flush=True)
        wall = time.time() - t0
        print("\n".join(["", *report(runs, gate)]))
        result = seed_result(args.preset, runs, {s: ratio for s, (ratio, _) in gate.items()}, wall)
        if args.home:
            Home(home).store.write_json("report", seeds_name(args.preset), data=result)
            print(f"kept in {home} (reports/{seeds_name(args.preset)}): the report card reads it")
        print(json.dumps(result))
    print(
        C.kv_line(
            {"preset": args.preset, "seeds": len(runs), "wall_s": wall, "gate_worst": max(r for r, _ in gate.values())}
        )
    )
    return 0


if __name__ == "__main__":
    C.main_wrapper(main)

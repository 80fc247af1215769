"""Fixed costs of a stage launch (issue 26): what a small run pays besides its training loop.

Measured, through the real entry point:
- the entry point's imports: `python -X importtime -m ghostvis_core.run --help` (the sum of its
  top-level imports) and the wall time of `python -m ghostvis_core.run --help`;
- one smoke stage: `ghostvis prepare pretrain --preset smoke` (untimed), then the line it prints,
  `torchrun --standalone --nproc_per_node=2 -m ghostvis_core.run --spec URI` (gloo, 1 thread per rank), in a
  scratch home (its MLflow store created beforehand,
  as a home's is before its first stage), every output line time-stamped: launch -> the run's start
  line, launch -> the first optimizer step (the `[pretrain] step 1/` line), the training loop (step 1
  to the last step, inside the loop's own evaluations and checkpoints; from the step lines:
  (t_last - t_first) x steps / (steps - 1)) and the stage's wall (launch -> torchrun exits, the final
  evaluation, checkpoint, MLflow flush and model registration included);
- the floor under launch -> first step: the bare PyTorch DDP loop (benchmarks/_bare_loop.py, same model and
  precision, under the same torchrun) from launch to its first optimizer step. Also the trainer's own
  `first_step_s` (RUN_COMPLETE.json; counted from the start of its setup, after the imports) and the
  CPU seconds the launch's processes had used when step 1's line arrived (not stretched by other load).

Goals: launch -> first optimizer step <= 5 s on 2 cores; a smoke stage's wall <= 2 x its training loop.

    .venv/bin/python benchmarks/fixed_costs.py [--home PATH] [--repeats 1] [--keep]
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

from ghostvis_core.home import Home  # noqa: E402

GOAL_FIRST_STEP_S = 5.0
GOAL_WALL_OVER_LOOP = 2.0
IMPORT_LINE = re.compile(r"^import time:\s+\d+ \|\s+(?P<cumulative>\d+) \| (?P<module>\S.*)$")


def entry_point_imports(wd: Path) -> dict:
    """Wall time of `python -m ghostvis_core.run --help`, and the sum of its top-level imports (-X importtime)."""
    cmd = [C.PY, "-m", "ghostvis_core.run", "--help"]
    t0 = time.time()
    subprocess.run(cmd, cwd=C.ROOT, env=C.clean_env(), capture_output=True, check=True)
    wall = time.time() - t0
    out = subprocess.run(
        [C.PY, "-X", "importtime", *cmd[1:]], cwd=C.ROOT, env=C.clean_env(), capture_output=True, text=True, check=True
    ).stderr
    (wd / "importtime.txt").write_text(out)
    top = sorted(
        ((int(m["cumulative"]) / 1e6, m["module"]) for m in map(IMPORT_LINE.match, out.splitlines()) if m), reverse=True
    )
    return {"wall_s": wall, "imports_s": sum(s for s, _ in top), "largest": top[:5]}


def create_mlflow_store(home: Path) -> None:
    """The home's MLflow database with its tables, as a home has it before its first stage runs (creating
    the tables is a one-off of a new home, not a cost of every launch)."""
    code = "import sys; from mlflow.tracking import MlflowClient; MlflowClient(sys.argv[1]).search_experiments()"
    subprocess.run(
        [C.PY, "-c", code, f"sqlite:///{home}/mlflow.db"],
        cwd=C.ROOT,
        env=C.clean_env(home),
        capture_output=True,
        check=True,
    )


def launch_cpu_s() -> float:
    """CPU seconds used so far by the processes this benchmark started (torchrun and its ranks): a figure
    other load on the machine does not stretch, unlike the wall time."""
    table, me = C.process_table(), os.getpid()
    ours = (proc.ticks for pid, proc in table.items() if pid != me and C.descends_from(pid, me, table))
    return sum(ours) / os.sysconf("SC_CLK_TCK")


def smoke_stage(src: Path, wd: Path, tag: str) -> dict:
    """One smoke pretrain stage in a fresh scratch home; its fixed costs from the time-stamped lines."""
    home = C.scratch_home(src, wd / f"home-{tag}")
    create_mlflow_store(home)
    cpu_at_step_1: list[float] = []

    def note_cpu(line: str, run: C.StageRun) -> bool:
        if not cpu_at_step_1 and C.STEP_RE.match(line):
            cpu_at_step_1.append(launch_cpu_s())
        return False

    run = C.run_stage(home, "pretrain", "smoke", [], log=wd / f"stage-{tag}.log", timeout=900, stop_when=note_cpu)
    if run.run_complete is None or len(run.steps) < 2:
        raise C.BenchError(f"the smoke stage did not complete with step lines; log {run.log}")
    start = run.first_line(lambda line: C.START_RE.match(line) is not None)
    first, last = run.steps[0], run.steps[-1]
    if first["step"] != 1 or last["step"] != last["total"]:
        raise C.BenchError(
            f"expected step lines 1 and {last['total']}, got {first['step']} and {last['step']}; log {run.log}"
        )
    loop = (last["t"] - first["t"]) * last["total"] / (last["total"] - 1)
    spec = str(Home(home).store.fetch("run_spec", "pretrain", run.run_key))
    precision = "bf16" if start and "bf16=True" in start[1] else "fp32"  # as the trainer chose (its start line)
    bare = C.bare_run(spec, wd, steps=3, precision=precision, tag=tag)
    shutil.rmtree(home, ignore_errors=True)
    return {
        "tag": tag,
        "start_line_s": start[0] if start else None,
        "first_step_s": first["t"],
        "bare_first_step_s": bare["first_step_s_wall"],
        "cpu_to_step_1_s": cpu_at_step_1[0] if cpu_at_step_1 else None,
        "loop_s": loop,
        "after_loop_s": run.wall - last["t"],
        "wall_s": run.wall,
        "steps": last["total"],
        "trainer_first_step_s": run.run_complete.first_step_s,
        "other_cores": run.other_cores,
    }


def main() -> int:
    ap = C.arguments(__doc__, C.TOKENIZED_HOME_HELP)
    ap.add_argument("--repeats", type=int, default=1, help="smoke stages to launch (medians reported)")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()

    print(C.load_snapshot("before fixed_costs"), flush=True)
    with C.work_folder("fixed", keep=args.keep) as wd:
        imports = entry_point_imports(wd)
        print(
            f"entry point: `python -m ghostvis_core.run --help` {imports['wall_s']:.2f}s wall, top-level imports "
            f"{imports['imports_s']:.2f}s; largest: " + ", ".join(f"{name} {s:.2f}s" for s, name in imports["largest"]),
            flush=True,
        )
        src, how = C.home_arg_or_build(args.home, wd)
        print(f"data home: {how}", flush=True)
        runs = []
        for i in range(args.repeats):
            print(
                f"smoke stage {i + 1}/{args.repeats}: ghostvis prepare pretrain --preset smoke, then its "
                "torchrun --nproc_per_node=2 -m ghostvis_core.run --spec ...",
                flush=True,
            )
            runs.append(smoke_stage(src, wd, str(i)))

        print()
        print(
            C.table(
                [
                    [
                        r["tag"],
                        r["start_line_s"],
                        r["first_step_s"],
                        r["bare_first_step_s"],
                        r["cpu_to_step_1_s"],
                        r["trainer_first_step_s"],
                        r["loop_s"],
                        r["after_loop_s"],
                        r["wall_s"],
                        r["other_cores"],
                    ]
                    for r in runs
                ],
                [
                    "run",
                    "launch->start line s",
                    "launch->step 1 s",
                    "bare loop: launch->step 1 s",
                    "CPU s to step 1",
                    "trainer first_step_s",
                    "loop s",
                    "last step->exit s",
                    "wall s",
                    "other cores",
                ],
            )
        )
        print()
        med = {
            k: statistics.median(r[k] for r in runs)
            for k in ("first_step_s", "bare_first_step_s", "cpu_to_step_1_s", "loop_s", "wall_s")
        }
        wall_over_loop = med["wall_s"] / med["loop_s"]
        first_over_goal = med["first_step_s"] / GOAL_FIRST_STEP_S
        print(
            C.goal(
                "launch -> first optimizer step",
                med["first_step_s"],
                GOAL_FIRST_STEP_S,
                higher_is_better=False,
                unit="s",
            )
            + f" (ratio to goal {first_over_goal:.2f})"
        )
        print(
            f"  the bare PyTorch DDP loop (benchmarks/_bare_loop.py: same model, precision and torchrun, no data, no "
            f"accounting, no tracking) reaches its first step {med['bare_first_step_s']:.2f}s after launch: GhostVis "
            f"adds {med['first_step_s'] - med['bare_first_step_s']:.2f}s (= {med['first_step_s']:.2f} - "
            f"{med['bare_first_step_s']:.2f})"
            " for the run's preparation, pre-flight, data, step-0 evaluation and tracking"
        )
        print(
            C.goal("stage wall / training loop", wall_over_loop, GOAL_WALL_OVER_LOOP, higher_is_better=False)
            + f" (ratio to goal {wall_over_loop / GOAL_WALL_OVER_LOOP:.2f})"
        )
        worst = max(r["other_cores"] for r in runs)
        print(f"other load during the stages: up to {worst:.2f} cores ({C.noise_note(worst)})")
        print(
            C.kv_line(
                {
                    "import_s": imports["imports_s"],
                    "entry_help_wall_s": imports["wall_s"],
                    "first_step_s": med["first_step_s"],
                    "bare_first_step_s": med["bare_first_step_s"],
                    "cpu_to_step_1_s": med["cpu_to_step_1_s"],
                    "loop_s": med["loop_s"],
                    "wall_s": med["wall_s"],
                    "wall_over_loop": wall_over_loop,
                    "first_step_over_goal": first_over_goal,
                    "wall_over_loop_over_goal": wall_over_loop / GOAL_WALL_OVER_LOOP,
                    "max_other_cores": worst,
                    "goal_met": int(first_over_goal <= 1 and wall_over_loop <= GOAL_WALL_OVER_LOOP),
                }
            )
        )
        return 0


if __name__ == "__main__":
    C.main_wrapper(main)

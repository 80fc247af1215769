"""Time to resume (launch to first training step) from an early and a late checkpoint of one run.

A pretrain run (tiny preset, 120 steps, a checkpoint every 20 steps, all kept, a log line every
step) is trained once through the real entry point. Then, for the early (step 20) and the late
(step 100) checkpoint: the run's home is copied, checkpoints after that one, RUN_COMPLETE.json and
the ledger parts written after it are deleted (the state a crash there would leave), and the
same torchrun command is launched again, so the same run key is found and resumed. Measured: from
just before Popen to the first "[pretrain] step k/" line after the "resume from step" line (the
run is stopped there). Early and late alternate (early, late, late, early, ...).

Goal (docs/invariants.md, invariant 2, "the cost of resuming does not grow with the step"):
late/early ~ 1.0, counted as met at <= 1.10.

    .venv/bin/python benchmarks/resume_time.py [--home PATH] [--steps 120] [--every 20] [--repeats 2]
"""

from __future__ import annotations

import re
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

from ghostvis_core.data.ledger import Ledger  # noqa: E402
from ghostvis_core.data.ledger.records import PART_TABLES  # noqa: E402
from ghostvis_core.home import Home  # noqa: E402

GOAL_RATIO = 1.10


def truncate_to(home: Path, run_key: str, step: int) -> None:
    """Leave the run as a crash right after checkpoint `step` would: later checkpoints, the
    completion record and the later ledger parts gone."""
    store = Home(home).store
    run_dir = store.fetch("checkpoints", "pretrain", run_key)  # a folder store's own folder, cut below
    for p in run_dir.iterdir():
        m = re.fullmatch(r"step_(\d{9})", p.name)
        if m and int(m.group(1)) > step:
            shutil.rmtree(p)
    store.delete("run_record", "pretrain", run_key)
    ledger = Ledger.in_store(store)
    for part in ledger.parts([run_key]):
        if part.step_last > step:
            for table in PART_TABLES:
                ledger.part_file(table, part).unlink(missing_ok=True)


def resume_once(base: Path, wd: Path, run_key: str, step: int, preset: str, sets: list[str], tag: str) -> dict:
    home = wd / f"home-{tag}"
    if home.exists():
        shutil.rmtree(home)

    def later_checkpoints(d: str, names: list[str]) -> list[str]:
        return [n for n in names if re.fullmatch(r"step_(\d{9})", n) and int(n[5:]) > step]

    shutil.copytree(base, home, symlinks=True, ignore=later_checkpoints)
    truncate_to(home, run_key, step)
    seen = {"resume": None}

    def stop(line: str, run: C.StageRun) -> bool:
        m = C.START_RE.match(line)
        if m:
            seen["resume"] = m["what"]
        return seen["resume"] is not None and C.STEP_RE.match(line) is not None

    run = C.run_stage(home, "pretrain", preset, sets, log=wd / f"resume-{tag}.log", timeout=600, stop_when=stop)
    start = run.first_line(lambda line: C.START_RE.match(line) is not None)
    if run.run_key != run_key or not seen["resume"] or f"resume from step {step}" not in seen["resume"]:
        raise C.BenchError(
            f"resume {tag}: expected run {run_key} to resume from step {step}, got "
            f"{run.run_key}: {seen['resume']!r}; log {run.log}"
        )
    if not run.steps:
        raise C.BenchError(f"resume {tag}: no training step after the resume line; log {run.log}")
    first = run.steps[0]
    shutil.rmtree(home, ignore_errors=True)
    return {
        "tag": tag,
        "step": step,
        "first_step": first["step"],
        "t_first_step": first["t"],
        "t_start_line": start[0] if start else None,
        "other_cores": run.other_cores,
    }


def main() -> int:
    ap = C.arguments(__doc__, C.TOKENIZED_HOME_HELP)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--every", type=int, default=20, help="checkpoint every N steps (default 20)")
    ap.add_argument("--repeats", type=int, default=2, help="resumes from each checkpoint (alternating)")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    early, late = args.every, args.steps - args.every
    if not 0 < early < late:
        raise C.BenchError(f"--steps {args.steps} / --every {args.every}: need a checkpoint before the last one")

    print(C.load_snapshot("before resume_time"), flush=True)
    with C.work_folder("resume", keep=args.keep) as wd:
        src, how = C.home_arg_or_build(args.home, wd)
        base = C.scratch_home(src, wd / "run_home")
        print(f"data home: {how}", flush=True)
        sets = [
            f"budget.steps={args.steps}",
            f"checkpoint.every_steps={args.every}",
            "checkpoint.keep_last=1000",
            "eval.every_steps=1000000",
            "runtime.log_every_steps=1",
        ]
        print(f"training the run: pretrain --preset {args.preset} --set {' --set '.join(sets)}", flush=True)
        run = C.run_stage(base, "pretrain", args.preset, sets, log=wd / "train.log", timeout=900)
        if run.run_complete is None:
            raise C.BenchError(f"the run did not complete; log {run.log}")
        run_key = run.run_key
        fresh_first = run.steps[0]["t"] if run.steps else None
        print(
            f"  run {run_key}: {run.run_complete.steps} steps in {run.wall:.0f}s "
            f"(fresh start: launch -> step 1 in {fresh_first:.2f}s)",
            flush=True,
        )

        order = []
        for i in range(args.repeats):
            order += [("early", early), ("late", late)] if i % 2 == 0 else [("late", late), ("early", early)]
        results = []
        for i, (name, step) in enumerate(order):
            print(f"resume {i + 1}/{len(order)}: {name} (checkpoint step {step}) ...", flush=True)
            results.append(resume_once(base, wd, run_key, step, args.preset, sets, f"{name}{i}") | {"name": name})

        rows = [
            [
                r["name"],
                r["step"],
                r["first_step"],
                r["t_start_line"],
                r["t_first_step"],
                r["t_first_step"] - r["t_start_line"] if r["t_start_line"] is not None else None,
                r["other_cores"],
            ]
            for r in results
        ]
        print()
        print(
            C.table(
                rows,
                [
                    "resume",
                    "checkpoint step",
                    "first step",
                    "launch->resume line s",
                    "launch->first step s",
                    "resume line->first step s",
                    "other cores",
                ],
            )
        )
        print()
        med = {n: statistics.median(r["t_first_step"] for r in results if r["name"] == n) for n in ("early", "late")}
        ratio = med["late"] / med["early"]
        print(
            f"median launch -> first step: early {med['early']:.2f}s, late {med['late']:.2f}s "
            f"(fresh start of the same run: {fresh_first:.2f}s, incl. the step-0 evaluation a resume skips)"
        )
        print(C.goal("resume time late/early", ratio, GOAL_RATIO, higher_is_better=False))
        worst = max(r["other_cores"] for r in results)
        print(f"other load during the resumes: up to {worst:.2f} cores ({C.noise_note(worst)})")
        print(
            C.kv_line(
                {
                    "resume_early_s": med["early"],
                    "resume_late_s": med["late"],
                    "late_over_early": ratio,
                    "fresh_first_step_s": fresh_first,
                    "early_step": early,
                    "late_step": late,
                    "max_other_cores": worst,
                    "goal_met": int(ratio <= GOAL_RATIO),
                }
            )
        )
        return 0


if __name__ == "__main__":
    C.main_wrapper(main)

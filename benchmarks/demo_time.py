"""Wall time of `ghostvis demo` in a fresh home, vs the 600 s goal.

Runs `.venv/bin/ghostvis demo --preset P` (default tiny, what `make demo` runs) with GHOSTVIS_HOME
in a new temp dir, prints the per-asset breakdown the command prints, the total wall time, and per
training stage the validation loss before/after and the evidence (from the runs' RUN_COMPLETE.json
files under <home>/store/checkpoints/<stage>/<run_key>/). If the demo fails, what was measured up to
the failure (per-asset times from Dagster's step events, finished stages) is printed and the script
exits 1.

    .venv/bin/python benchmarks/demo_time.py [--preset tiny|smoke] [--keep-home DIR]
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

from ghostvis_core.home import Home  # noqa: E402
from ghostvis_core.plan.stages import stage_names  # noqa: E402
from ghostvis_core.runs.lookup import newest_completed_run  # noqa: E402
from ghostvis_core.runs.run_result import RunResult  # noqa: E402

GOAL_S = 600.0
STAGES = stage_names()
STEP_DONE = re.compile(
    r'(STEP_SUCCESS|STEP_FAILURE) - (?:Finished execution of step|Execution of step) "([^"]+)"'
    r"(?: in ([\d.]+(?:ms|s)|\d+m\d+s|\d+h\d+m))?"
)


def summary_block(lines: list[str]) -> list[str]:
    """The per-asset table `ghostvis demo` prints at the end (header 'asset  seconds' to 'checks:')."""
    start = max(
        (i for i, line in enumerate(lines) if re.match(r"^asset\s+seconds(\s+\(checks\))?$", line)), default=None
    )
    if start is None:
        return []
    out = []
    for line in lines[start:]:
        out.append(line)
        if line.startswith("checks:"):
            break
    return out


def _seconds(text: str | None) -> float | None:
    if not text:
        return None
    if text.endswith("ms"):
        return float(text[:-2]) / 1000
    m = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:([\d.]+)s)?", text)
    if not m:
        return None
    h, mi, s = (float(x) if x else 0.0 for x in m.groups())
    return h * 3600 + mi * 60 + s


def step_events(lines: list[str]) -> list[list]:
    """[step, status, seconds] from Dagster's STEP_SUCCESS / STEP_FAILURE log lines."""
    out = []
    for line in lines:
        m = STEP_DONE.search(line)
        if m:
            out.append([m.group(2), "ok" if m.group(1) == "STEP_SUCCESS" else "FAILED", _seconds(m.group(3))])
    return out


def stage_results(home: Path) -> list[RunResult]:
    """Each stage's newest completed run."""
    store = Home(home).store
    return [r for r in (newest_completed_run(store, stage) for stage in STAGES) if r is not None]


def print_stages(home: Path) -> dict:
    rows, evidence_rows, losses = [], [], {}
    for r in stage_results(home):
        rows.append([r.stage, r.steps, r.val_loss_start, r.val_loss, r.tokens_per_sec, r.first_step_s, r.wall_time_s])
        losses[f"{r.stage}_val_loss"] = r.val_loss
        for name, e in sorted(r.evidence.items()):
            evidence_rows.append([r.stage, name, e.before, e.after])
        if r.frozen is not None:
            evidence_rows.append([r.stage, "frozen_params_unchanged", None, int(r.frozen.unchanged)])
    if rows:
        print(
            C.table(rows, ["stage", "steps", "val loss start", "val loss end", "tok/s", "first step s", "train wall s"])
        )
    else:
        print("no training stage completed")
    if evidence_rows:
        print()
        print(C.table(evidence_rows, ["stage", "evidence", "before", "after"]))
    return losses


def main() -> int:
    ap = C.arguments(__doc__)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument(
        "--keep-home",
        help="build the home here (must not exist) and keep it, e.g. for the other "
        "benchmarks (run_all.py passes it on as --home)",
    )
    ap.add_argument("--timeout", type=float, default=1800.0)
    args = ap.parse_args()

    print(C.load_snapshot("before demo_time"), flush=True)
    with C.work_folder("demo", what=" (log)") as wd:
        if args.keep_home:
            home = Path(args.keep_home).expanduser().resolve()
            if home.exists():
                raise C.BenchError(f"--keep-home {home} exists; the demo is timed in a fresh home")
        else:
            home = wd / "home"
        home.parent.mkdir(parents=True, exist_ok=True)
        if args.keep_home:
            print(f"home kept at {home}")
        cmd = [*C.GHOSTVIS, "demo", "--preset", args.preset]
        print(f"$ GHOSTVIS_HOME={home} {' '.join(cmd)}", flush=True)
        log = wd / "demo.log"
        p = C.run_lines(cmd, C.clean_env(home), log, timeout=args.timeout, check=False)
        lines = [line for _, line in p.lines]
        block = summary_block(lines)
        print()
        if block:
            print("\n".join(block))
        else:  # failed before its summary: what Dagster recorded up to the failure
            print(
                f"`ghostvis demo` exited {p.rc} after {p.wall:.1f}s without its summary; per-step times from "
                "Dagster's events:"
            )
            print(C.table(step_events(lines), ["step", "status", "seconds"]))
        print()
        losses = print_stages(home)
        print()
        if not block or p.rc not in (0, 1):  # 1 with a summary = some checks failed, still a measurement
            err = next(
                (
                    line.strip()
                    for line in reversed(lines)
                    if re.match(r"^\s*\w*(Error|Exception|Failure)\b", line.strip())
                ),
                lines[-1] if lines else "",
            )
            raise C.BenchError(
                f"`ghostvis demo --preset {args.preset}` failed (exit {p.rc}) after {p.wall:.0f}s: {err}; log {log}"
            )
        checks = next((line for line in block if line.startswith("checks:")), "checks: ?")
        print(f"demo exit code {p.rc}; {checks}")
        print(
            C.goal(f"ghostvis demo --preset {args.preset} wall time", p.wall, GOAL_S, higher_is_better=False, unit=" s")
        )
        print(f"other load during the demo: {p.other_cores:.2f} cores ({C.noise_note(p.other_cores)})")
        results = {
            "preset": args.preset,
            "demo_wall_s": p.wall,
            "exit_code": p.rc,
            "max_other_cores": p.other_cores,
            "goal_met": int(p.wall <= GOAL_S),
            **losses,
        }
        print(C.kv_line(results))
        return 0


if __name__ == "__main__":
    C.main_wrapper(main)

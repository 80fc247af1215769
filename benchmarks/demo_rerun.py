"""A second `ghostvis demo` on the same home vs the first: every stage a cache hit.

Runs `.venv/bin/ghostvis demo --preset P` (default smoke) twice with the same GHOSTVIS_HOME (a new
temp dir, or --keep-home DIR), and prints both per-asset tables, the wall times and their ratio,
and what the second run added: MLflow runs (counted in the home's MLflow store) and run folders
under store/checkpoints (both must stay the same), and the checks (all must pass). Goal: second /
first <= 0.10 (docs/architecture.md, "Identity and caching").

    .venv/bin/python benchmarks/demo_rerun.py [--preset tiny|smoke] [--keep-home DIR]
"""

from __future__ import annotations

import sqlite3
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
from demo_time import summary_block  # noqa: E402

from ghostvis_core.home import Home  # noqa: E402

GOAL_RATIO = 0.10


def mlflow_runs(home: Path) -> int:
    """Runs in the home's MLflow store (sqlite, as `clean_env` sets it)."""
    with sqlite3.connect(home / "mlflow.db") as db:
        return db.execute("select count(*) from runs").fetchone()[0]


def run_folders(home: Path) -> int:
    """Run folders (one per attempt) under the store's checkpoints, every stage."""
    return len(Home(home).store.keys("checkpoints"))


def demo(home: Path, preset: str, log: Path, timeout: float) -> tuple[float, list[str], int]:
    cmd = [*C.GHOSTVIS, "demo", "--preset", preset]
    p = C.run_lines(cmd, C.clean_env(home), log, timeout=timeout, check=False)
    block = summary_block([line for _, line in p.lines])
    if not block:
        raise C.BenchError(f"`{' '.join(cmd)}` exited {p.rc} after {p.wall:.0f}s without its summary; log {log}")
    print("\n".join(block), flush=True)
    return p.wall, block, p.other_cores


def main() -> int:
    ap = C.arguments(__doc__)
    ap.add_argument("--preset", default="smoke")
    ap.add_argument("--keep-home", help="build the home here (must not exist) and keep it")
    ap.add_argument("--timeout", type=float, default=3600.0)
    args = ap.parse_args()

    print(C.load_snapshot("before demo_rerun"), flush=True)
    with C.work_folder("demo_rerun", what=" (logs)") as wd:
        home = Path(args.keep_home).expanduser().resolve() if args.keep_home else wd / "home"
        if home.exists():
            raise C.BenchError(f"--keep-home {home} exists; the first demo is timed in a fresh home")
        if args.keep_home:
            print(f"home kept at {home}")
        print(f"first demo (GHOSTVIS_HOME={home}):", flush=True)
        first, _, noise1 = demo(home, args.preset, wd / "first.log", args.timeout)
        runs1, folders1 = mlflow_runs(home), run_folders(home)
        print("\nsecond demo, same home:", flush=True)
        second, block, noise2 = demo(home, args.preset, wd / "second.log", args.timeout)
        runs2, folders2 = mlflow_runs(home), run_folders(home)
        checks = next((line for line in block if line.startswith("checks:")), "checks: ?")
        print()
        print(
            C.table(
                [["first", first, runs1, folders1], ["second", second, runs2, folders2]],
                ["demo", "wall s", "MLflow runs after", "run folders after"],
            )
        )
        print(f"second run: {checks}; new MLflow runs {runs2 - runs1}, new run folders {folders2 - folders1}")
        print(
            C.goal(f"second / first demo wall time ({args.preset})", second / first, GOAL_RATIO, higher_is_better=False)
        )
        print(f"other load: {max(noise1, noise2):.2f} cores ({C.noise_note(max(noise1, noise2))})")
        print(
            C.kv_line(
                {
                    "preset": args.preset,
                    "first_s": first,
                    "second_s": second,
                    "ratio": second / first,
                    "new_mlflow_runs": runs2 - runs1,
                    "new_run_folders": folders2 - folders1,
                    "goal_met": int(second / first <= GOAL_RATIO and runs2 == runs1 and folders2 == folders1),
                }
            )
        )
        return 0


if __name__ == "__main__":
    C.main_wrapper(main)

"""Run every benchmark in sequence (what `make bench` runs), sharing one demo home.

demo_time.py builds the home (a full `ghostvis demo`, timed) and keeps it; trainer_throughput.py, fixed_costs.py,
tokenize_throughput.py, resume_time.py and content_digest.py then read its tokenized data (each trains in its own
scratch copy, so the home is not changed); ledger_scale.py adds ledger parts to a copy of it.
With --home, the demo is not re-run and that home is used.
At the end, every script's final key=value line is repeated.

    .venv/bin/python benchmarks/run_all.py [--preset tiny] [--home PATH] [--only NAME ...]
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

HERE = Path(__file__).resolve().parent
ORDER = (
    "demo_time",
    "trainer_throughput",
    "fixed_costs",
    "tokenize_throughput",
    "resume_time",
    "content_digest",
    "ledger_scale",
    "scale",
)
OWN_HOMES = {"scale": ["--no-ledger"]}  # builds its homes per shard count; its ledger side is ledger_scale's run


def run(name: str, extra: list[str]) -> tuple[int, str, float]:
    cmd = [C.PY, str(HERE / f"{name}.py"), *extra]
    print(f"\n===== {name}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=C.ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    last_kv = ""
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        if "=" in line and " " in line.strip() and all("=" in tok for tok in line.split()):
            last_kv = line.strip()
    rc = proc.wait()
    return rc, last_kv, time.time() - t0


def main() -> int:
    ap = C.arguments(__doc__)
    ap.add_argument("--preset", default="tiny", help="preset of the timed demo (default tiny)")
    ap.add_argument("--home", help="use this home and skip demo_time")
    ap.add_argument("--only", nargs="*", choices=ORDER, help="run only these benchmarks")
    ap.add_argument("--keep-home", action="store_true", help="keep the home demo_time builds")
    args = ap.parse_args()

    names = [n for n in ORDER if not args.only or n in args.only]
    home = args.home
    results: list[tuple[str, int, str, float]] = []
    with contextlib.ExitStack() as scratch:
        if home:
            names = [n for n in names if n != "demo_time"]
        elif "demo_time" in names:
            wd = scratch.enter_context(C.work_folder("all", keep=args.keep_home, what=" (the home demo_time built)"))
            home = str(wd / "home")
            rc, kv, secs = run("demo_time", ["--preset", args.preset, "--keep-home", home])
            results.append(("demo_time", rc, kv, secs))
            names.remove("demo_time")
            if not (Path(home) / "store" / "ledger" / "shards").is_dir():
                print("demo_time left no tokenized data; the other benchmarks build their own homes", flush=True)
                home = None
            elif rc != 0:
                print("demo_time failed, but its home has tokenized data: the others use it", flush=True)
        for name in names:
            rc, kv, secs = run(name, OWN_HOMES.get(name, ["--home", home] if home else []))
            results.append((name, rc, kv, secs))

    print("\n===== summary")
    for name, rc, kv, secs in results:
        print(f"{name} ({secs:.0f}s, exit {rc}): {kv or '(no results)'}")
    failed = [n for n, rc, _, _ in results if rc != 0]
    print(("errors in: " + ", ".join(failed)) if failed else "all benchmarks ran")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

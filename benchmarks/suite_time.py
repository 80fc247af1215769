"""The test suite's wall time against issue 26's goal (under 20 minutes on 2 cores), and where its CPU goes.

The suite is CPU-bound (both cores busy ~95% of its wall time), so only less CPU makes it shorter; this says
which processes spend it. It runs the README's test command (`.venv/bin/pytest -q`, with the arguments given
here appended) and, every second, reads each process's own CPU time (utime + stime) from /proc. A process is
counted when the first read that sees it finds pytest among its ancestors, or finds it a daemon (its parent is
init: slurmd, postgres, a namespace's holder) started after pytest; by the last value read before it exited,
under the kind its command line names (training ranks, torchrun, `ghostvis demo`, `dagster` CLIs, the MLflow
server, Chromium...).

It also reads, at each sample, the used space of the filesystem that holds pytest's temporary folders, and prints
its peak above the start: what the suite needs free on the disk (its homes, checkpoints and buckets, kept while a
test file runs).

A process that lives less than a second between two reads is missed; the coverage line compares the sum with
what the kernel accounted to pytest's own tree (getrusage of its waited-for descendants, which misses in turn
the daemons that Slurm, PostgreSQL and namespaces leave to init).

    .venv/bin/python benchmarks/suite_time.py [pytest args, e.g. tests/test_ledger.py -n 0]
"""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

GOAL_WALL_S = 20 * 60
SAMPLE_S = 1.0
HZ = os.sysconf("SC_CLK_TCK")
# The kind of a process, by the first pattern its command line matches (in this order).
KINDS = [
    ("torchrun (launching ranks)", r"torch\.distributed\.run|bin/torchrun"),  # its command line names the ranks'
    ("training rank (ghostvis_core.run)", r"-m ghostvis_core\.run( |$)"),
    ("training rank (tests.planted scenarios)", r"-m tests\.planted"),
    ("model registration subprocess", r"ghostvis_core\.run\.hf\.register"),
    ("ghostvis demo", r"bin/ghostvis demo"),
    ("ghostvis CLI (audit, export, ledger...)", r"bin/ghostvis "),
    ("dagster asset/job CLI", r"bin/dagster (asset|job)"),
    (
        "dagster dev, webserver, daemon, code server",
        r"dagster(-webserver|_webserver|-daemon|\._daemon| dev| api| code-server)",
    ),
    ("dagster step or run subprocess", r"dagster[/.]_core|dagster[/.]_cli"),
    ("tokenize pool workers (forkserver)", r"forkserver"),
    ("MLflow server", r"mlflow (server|ui)|gunicorn|uvicorn|huey"),
    ("Python multiprocessing children (spawn)", r"multiprocessing\.spawn"),
    ("moto S3 server", r"moto"),
    ("Chromium", r"chrom"),
    ("Playwright driver", r"playwright|node "),
    ("pytest and its workers", r"exec\(eval\(sys\.stdin|bin/pytest"),
    ("Slurm and munge", r"slurm|munge|srun|sbatch|scontrol|squeue|sacct"),
    ("PostgreSQL", r"postgres|initdb|pg_ctl"),
    ("test helpers (tests.hosts, tests.slurm_cluster...)", r"-m tests\."),
]


def kind_of(cmdline: str) -> str:
    return next((kind for kind, pattern in KINDS if re.search(pattern, cmdline)), "other")


def used_bytes(path: str) -> int:
    """The used space of the filesystem holding `path`."""
    fs = os.statvfs(path)
    return (fs.f_blocks - fs.f_bfree) * fs.f_frsize


class ProcessLedger:
    """The suite's processes: (pid, start) -> [CPU ticks at the last read, command line]; and the peak of the
    temporary folders' filesystem's used space above what it was at the start."""

    def __init__(self, root: int):
        self.root = root
        self.since = C.process_table()[root].start
        self.seen: dict[tuple[int, int], list] = {}
        self.stop = threading.Event()
        self.used_at_start = used_bytes(tempfile.gettempdir())
        self.disk_peak = 0

    def sample(self) -> None:
        self.disk_peak = max(self.disk_peak, used_bytes(tempfile.gettempdir()) - self.used_at_start)
        table = C.process_table()
        for pid, proc in table.items():
            entry = self.seen.get((pid, proc.start))
            if entry is not None:
                entry[0] = proc.ticks
            elif proc.start >= self.since and (proc.ppid == 1 or C.descends_from(pid, self.root, table)):
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    continue
                self.seen[(pid, proc.start)] = [proc.ticks, cmdline]

    def run(self) -> None:
        while not self.stop.wait(SAMPLE_S):
            self.sample()

    def by_kind(self) -> tuple[Counter, Counter, Counter]:
        """CPU seconds and processes per kind, and CPU seconds per command line of kind "other"."""
        cpu, count, other = Counter(), Counter(), Counter()
        for ticks, cmdline in self.seen.values():
            kind = kind_of(cmdline)
            cpu[kind] += ticks / HZ
            count[kind] += 1
            if kind == "other":
                other[" ".join(cmdline.split())[:150]] += ticks / HZ
        return cpu, count, other


def main() -> int:
    print(C.load_snapshot("suite_time"), flush=True)
    cmd = [str(C.ROOT / ".venv" / "bin" / "pytest"), "-q", *sys.argv[1:]]
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=C.ROOT)
    ledger = ProcessLedger(proc.pid)
    sampler = threading.Thread(target=ledger.run, name="process-ledger", daemon=True)
    sampler.start()
    code = proc.wait()
    wall = time.time() - t0
    ledger.stop.set()
    sampler.join()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    tree_cpu = children.ru_utime + children.ru_stime

    cpu, count, other = ledger.by_kind()
    total = sum(cpu.values())
    cores = os.cpu_count() or 1
    rows = [[kind, seconds, 100 * seconds / total, count[kind]] for kind, seconds in cpu.most_common()]
    print(f"\n`{' '.join(cmd[1:])}` exited {code} after {wall:,.0f} s on {cores} cores\n")
    print(C.table(rows, ["kind of process", "CPU s", "% of CPU", "processes"]))
    if other:
        print("\nlargest of kind other: " + "; ".join(f"{cmd} ({secs:.1f} s)" for cmd, secs in other.most_common(5)))
    print(
        f"\nCPU of every process started by the suite: {total:,.0f} s = {total / wall:.2f} of {cores} cores busy "
        f"over the wall ({100 * total / (wall * cores):.0f}%)"
    )
    print(
        f"coverage: pytest's tree as the kernel accounted it (waited-for descendants): {tree_cpu:,.0f} s; "
        f"sampled once a second: {total:,.0f} s"
    )
    left = used_bytes(tempfile.gettempdir()) - ledger.used_at_start
    print(
        f"disk: the suite's peak on {tempfile.gettempdir()}'s filesystem {ledger.disk_peak / 1e9:.1f} GB above its "
        f"start, {left / 1e9:.1f} GB left behind when it ended"
    )
    print(C.goal("suite wall / 20 minutes", wall / GOAL_WALL_S, 1.0, higher_is_better=False))
    results = {"wall_s": wall, "cpu_s": total, "tree_cpu_s": tree_cpu, "busy": total / (wall * cores), "exit": code}
    results |= {"disk_peak_gb": ledger.disk_peak / 1e9, "disk_left_gb": left / 1e9}
    print(C.kv_line(results))
    return 0


if __name__ == "__main__":
    C.main_wrapper(main)

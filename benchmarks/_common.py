"""Shared helpers for the benchmark scripts (not a benchmark itself).

- machine load: a snapshot before a benchmark, and a CPU meter that says how many cores *other*
  processes used while something was measured (the machine has 2 cores; anything above ~0.2 makes
  a ratio noisy);
- demo homes: build one with `ghostvis demo`, or derive a scratch training home from an existing one
  (tokenizer and ledger shard rows copied, token shards symlinked) so benchmarks never write into a
  home they were given;
- running a stage with the real entry point (`ghostvis prepare`, then its `torchrun ... -m ghostvis_core.run --spec`),
  time-stamping every output line as it is read;
- goal lines ("goal met" / "goal missed") and the final key=value line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from ghostvis_core.home import Home
from ghostvis_core.runs.lookup import run_result
from ghostvis_core.runs.run_result import RunResult

ROOT = Path(__file__).resolve().parent.parent
_VENV_PY = ROOT / ".venv" / "bin" / "python"
PY = str(_VENV_PY) if _VENV_PY.exists() else sys.executable
_VENV_GHOSTVIS = ROOT / ".venv" / "bin" / "ghostvis"
GHOSTVIS = [str(_VENV_GHOSTVIS)] if _VENV_GHOSTVIS.exists() else [PY, "-m", "ghostvis_pipeline.cli"]

STEP_RE = re.compile(r"^\[(?P<stage>\w+)\] step (?P<step>\d+)/(?P<total>\d+) loss \S+ lr \S+ (?P<tps>[\d,.]+) tok/s")
START_RE = re.compile(r"^\[(?P<stage>\w+)\] run (?P<run_key>\S+) segment (?P<segment>\d+): (?P<what>[^;]+);")


class BenchError(RuntimeError):
    """A benchmark could not measure (as opposed to: it measured and a goal was missed)."""


# --- machine load -------------------------------------------------------------------------------


def load_snapshot(label: str = "") -> str:
    """uptime-style load averages plus the processes using CPU right now (top, second frame)."""
    la = os.getloadavg()
    lines = [
        f"machine load{(' ' + label) if label else ''}: loadavg {la[0]:.2f} {la[1]:.2f} {la[2]:.2f} "
        f"on {os.cpu_count()} cores"
    ]
    try:
        out = subprocess.run(
            ["top", "-bn2", "-d0.5", "-w", "200", "-c"], capture_output=True, text=True, timeout=10
        ).stdout
        frame = out.split("\ntop - ")[-1].splitlines()
        hdr = next(i for i, line in enumerate(frame) if line.lstrip().startswith("PID"))
        cpu_line = next((line for line in frame if line.startswith("%Cpu")), "")
        if cpu_line:
            lines.append("  " + cpu_line.strip())
        me = os.getpid()
        for line in frame[hdr + 1 :]:
            parts = line.split(None, 11)
            if len(parts) < 12:
                continue
            pid, cpu = int(parts[0]), float(parts[8].replace(",", "."))
            if cpu >= 5.0 and pid != me and not parts[11].startswith("top "):
                lines.append(f"  busy: pid {pid} {cpu:5.1f}% {parts[11][:110]}")
    except (OSError, subprocess.SubprocessError, StopIteration, ValueError):
        pass
    return "\n".join(lines)


class ProcStat(NamedTuple):
    ppid: int
    start: int  # clock ticks since boot: with the pid, the process's identity
    ticks: int  # its own CPU time so far (utime + stime), in clock ticks


def process_table() -> dict[int, ProcStat]:
    """Every process, read from /proc."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(d)] = ProcStat(int(fields[1]), int(fields[19]), int(fields[11]) + int(fields[12]))
    return out


def descends_from(pid: int, root: int, table: dict[int, ProcStat]) -> bool:
    """Whether `root` is `pid` or one of its ancestors in `table`."""
    for _ in range(64):
        if pid == root:
            return True
        if pid not in table or pid <= 1:
            return False
        pid = table[pid].ppid
    return False


class CpuMeter:
    """Wall time of a block, and the average number of cores used meanwhile by this process tree
    (own_cores) and by every other process (other_cores). A sampler thread reads /proc every
    `interval` seconds and attributes each process's CPU time to "own" when this process is among
    its ancestors (torchrun ranks, datatrove pool workers...), else to "other"."""

    def __init__(self, interval: float = 0.5):
        self.interval = interval
        self.own_cores = self.other_cores = 0.0

    def _sample(self) -> None:
        table = process_table()
        me = os.getpid()
        for pid, proc in table.items():
            prev = self._last.get(pid)
            delta = proc.ticks - prev if prev is not None else (proc.ticks if self._started else 0)
            if delta <= 0:
                continue
            if descends_from(pid, me, table):
                self._own += delta
            else:
                self._other += delta
        self._last = {pid: proc.ticks for pid, proc in table.items()}

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> CpuMeter:
        self._last, self._own, self._other, self._started = {}, 0, 0, False
        self._sample()
        self._started = True
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cpu-meter", daemon=True)
        self.t0 = time.time()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.wall = max(1e-9, time.time() - self.t0)
        self._stop.set()
        self._thread.join()
        self._sample()
        hz = os.sysconf("SC_CLK_TCK")
        self.own_cores = self._own / hz / self.wall
        self.other_cores = self._other / hz / self.wall


def noise_note(other_cores: float) -> str:
    return "quiet" if other_cores < 0.15 else ("some other load" if other_cores < 0.5 else "LOADED (noisy)")


# --- homes ----------------------------------------------------------------------------------------


def clean_env(home: Path | None = None) -> dict[str, str]:
    """The environment for a child: GHOSTVIS_HOME and the MLflow store inside it, no outer Dagster
    instance or Pipes variables, no preset override."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("DAGSTER_PIPES") and k not in ("DAGSTER_HOME", "GHOSTVIS_PRESET", "MLFLOW_TRACKING_URI")
    }
    if home is not None:
        env["GHOSTVIS_HOME"] = str(home)
        env["MLFLOW_TRACKING_URI"] = f"sqlite:///{home}/mlflow.db"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def build_demo_home(
    home: Path, *, preset: str = "smoke", stages: tuple[str, ...] = ("pretrain",), log: Path | None = None
) -> float:
    """`ghostvis demo --preset P --stages ...` into a fresh home (data, tokenizer, tokenized shards,
    ledger and the given stages). Returns the wall time."""
    home.mkdir(parents=True, exist_ok=True)
    log = log or home.parent / f"{home.name}-demo.log"
    cmd = [*GHOSTVIS, "demo", "--preset", preset, "--stages", *stages]
    print(
        f"building a demo home: GHOSTVIS_HOME={home} ghostvis demo --preset {preset} --stages {' '.join(stages)}",
        flush=True,
    )
    t0 = time.time()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, env=clean_env(home), stdout=f, stderr=subprocess.STDOUT).returncode
    wall = time.time() - t0
    if rc != 0:
        raise BenchError(f"`ghostvis demo` failed (exit {rc}) after {wall:.0f}s; log {log}:\n{tail(log)}")
    print(f"  demo home ready in {wall:.0f}s", flush=True)
    return wall


def check_home(home: Path) -> None:
    if not (home / "store" / "tokenizers").is_dir() or not (home / "store" / "ledger" / "shards").is_dir():
        raise BenchError(
            f"{home} is not a GhostVis home with tokenized data (no store/tokenizers or "
            f"store/ledger/shards); build one with `ghostvis demo --preset smoke --stages pretrain`"
        )


def scratch_home(src: Path, dst: Path) -> Path:
    """A fresh home for training runs that reads src's tokenized data: the tokenizers and the
    ledger's shard rows are copied, the shard files symlinked (ledger token paths are relative to
    the store). Runs, checkpoints, ledger parts and the MLflow store start empty; src is not touched."""
    check_home(src)
    store = dst / "store"
    store.mkdir(parents=True, exist_ok=False)
    shutil.copytree(src / "store" / "tokenizers", store / "tokenizers")
    for table in ("shards", "docs"):
        if (src / "store" / "ledger" / table).is_dir():
            shutil.copytree(src / "store" / "ledger" / table, store / "ledger" / table)
    os.symlink((src / "store" / "shards").resolve(), store / "shards")
    return dst


# --home's help for the benchmarks that train on a demo home's tokenized data (home_arg_or_build)
TOKENIZED_HOME_HELP = (
    "a GhostVis home with tokenized demo data (default: build one with "
    "`ghostvis demo --preset smoke --stages pretrain` in a temp dir)"
)


def arguments(doc: str, home_help: str = "") -> argparse.ArgumentParser:
    """A benchmark's command line: its module docstring, as written, for --help, and a --home option
    with `home_help` when the benchmark takes a home."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if home_help:
        ap.add_argument("--home", help=home_help)
    return ap


def home_arg_or_build(home_arg: str | None, workdir: Path, *, preset: str = "smoke") -> tuple[Path, str]:
    """The home to read tokenized data from: the one given, or a demo home built in workdir."""
    if home_arg:
        home = Path(home_arg).expanduser().resolve()
        check_home(home)
        return home, f"given ({home})"
    home = workdir / "demo_home"
    wall = build_demo_home(home, preset=preset, stages=("pretrain",), log=workdir / "demo_home.log")
    return home, f"built with ghostvis demo --preset {preset} --stages pretrain in {wall:.0f}s"


def tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


# --- running a stage through the real entry point ------------------------------------------------


@dataclass
class StageRun:
    cmd: list[str]
    rc: int
    wall: float
    lines: list[tuple[float, str]]  # (seconds since just before Popen, line)
    log: Path
    home: Path
    other_cores: float
    stopped_early: bool = False
    run_key: str | None = None
    run_complete: RunResult | None = None
    steps: list[dict] = field(default_factory=list)  # parsed step lines: t, step, total, tps

    def first_line(self, pred: Callable[[str], bool]) -> tuple[float, str] | None:
        return next(((t, line) for t, line in self.lines if pred(line)), None)


def torchrun_cmd(home: Path, stage: str, preset: str, sets: list[str], env: dict[str, str]) -> list[str]:
    """Plan the stage run in `home` on this host (`ghostvis prepare`, untimed: the job only runs specs) and
    return the torchrun line it printed, as `python -m torch.distributed.run` (what the torchrun script runs)."""
    cmd = [PY, "-m", "ghostvis_pipeline.cli", "prepare", stage, "--preset", preset]
    cmd += [a for s in sets for a in ("--set", s)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BenchError(f"`ghostvis prepare {stage}` exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    line = shlex.split(proc.stdout.strip().splitlines()[-1])
    return [PY, "-m", "torch.distributed.run", *line[1:]]


@dataclass
class Proc:
    cmd: list[str]
    rc: int
    wall: float
    lines: list[tuple[float, str]]  # (seconds since just before Popen, line)
    other_cores: float
    stopped_early: bool


def run_lines(
    cmd: list[str],
    env: dict[str, str],
    log: Path,
    *,
    timeout: float = 900.0,
    on_line: Callable[[float, str], bool | None] | None = None,
    check: bool = True,
) -> Proc:
    """Run cmd (stderr merged into stdout), time-stamping each output line as it is read. When
    on_line returns True the run is ended (SIGTERM to the process group we started)."""
    lines: list[tuple[float, str]] = []
    stopped = False
    timed_out = threading.Event()
    with CpuMeter() as meter, open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        t_launch = time.time()
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,
        )

        def _kill_on_timeout():
            timed_out.set()
            _stop(proc)

        timer = threading.Timer(timeout, _kill_on_timeout)
        timer.daemon = True
        timer.start()
        try:
            assert proc.stdout is not None
            for raw in proc.stdout:
                t = time.time() - t_launch
                line = raw.rstrip("\n")
                lines.append((t, line))
                f.write(f"{t:9.3f} {line}\n")
                if on_line is not None and not stopped and on_line(t, line):
                    stopped = True
                    _stop(proc)
            rc = proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:
                _stop(proc)
                proc.wait()
        wall = time.time() - t_launch
    if timed_out.is_set():
        raise BenchError(f"{' '.join(cmd[-8:])} did not finish within {timeout:.0f}s; log {log}")
    if check and rc != 0 and not stopped:
        raise BenchError(f"`{' '.join(cmd[2:8])} ...` exited with {rc}; log {log}:\n{tail(log)}")
    return Proc(cmd, rc, wall, lines, meter.other_cores, stopped)


def run_stage(
    home: Path,
    stage: str,
    preset: str,
    sets: list[str],
    *,
    log: Path,
    threads_per_rank: int = 1,
    timeout: float = 900.0,
    stop_when: Callable[[str, StageRun], bool] | None = None,
) -> StageRun:
    """Plan the run (`ghostvis prepare`, before the clock starts), launch the torchrun line it printed (as
    `python -m torch.distributed.run`, which is what the torchrun script runs) and read its output line by
    line, time-stamping each line when it is read (PYTHONUNBUFFERED=1): times count from torchrun's start.
    With stop_when, the run is ended (SIGTERM to its process group) once it returns True."""
    env = clean_env(home)
    env["OMP_NUM_THREADS"] = str(threads_per_rank)
    cmd = torchrun_cmd(home, stage, preset, sets, env)
    run = StageRun(cmd, -1, 0.0, [], log, home, 0.0)

    def on_line(t: float, line: str) -> bool:
        run.lines.append((t, line))
        m = START_RE.match(line)
        if m and run.run_key is None:
            run.run_key = m["run_key"]
        m = STEP_RE.match(line)
        if m:
            run.steps.append(
                {"t": t, "step": int(m["step"]), "total": int(m["total"]), "tps": float(m["tps"].replace(",", ""))}
            )
        return bool(stop_when and stop_when(line, run))

    p = run_lines(cmd, env, log, timeout=timeout, on_line=on_line)
    run.rc, run.wall, run.other_cores, run.stopped_early = p.rc, p.wall, p.other_cores, p.stopped_early
    if run.run_key:
        store = Home(home).store
        if store.exists("run_record", stage, run.run_key) and not run.stopped_early:
            run.run_complete = run_result(store, stage, run.run_key)
    return run


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group we started (torchrun and its ranks), SIGKILL if it lingers."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def window_rate(steps: list[dict], tokens_per_step: int, first: int, last: int) -> float | None:
    """Steady-state tokens/s between two logged steps, from the trainer's own cumulative
    `tok/s` figures (which count from the end of step 1): elapsed_k = (k - 1) x tps / rate_k."""
    by = {s["step"]: s for s in steps if s["tps"] > 0}
    if first not in by or last not in by or last <= first:
        return None
    el = {k: (k - 1) * tokens_per_step / by[k]["tps"] for k in (first, last)}
    return (last - first) * tokens_per_step / max(1e-9, el[last] - el[first])


def nearest_logged(steps: list[dict], target: int) -> int | None:
    logged = [s["step"] for s in steps if s["tps"] > 0]
    return min(logged, key=lambda k: abs(k - target)) if logged else None


# --- output --------------------------------------------------------------------------------------


def goal(name: str, value: float | None, target: float, *, higher_is_better: bool = True, unit: str = "") -> str:
    if value is None:
        return f"{name}: not measured -> goal missed (no value)"
    met = value >= target if higher_is_better else value <= target
    op = ">=" if higher_is_better else "<="
    return f"{name} = {value:.3f}{unit} (goal {op} {target}{unit}) -> goal {'met' if met else 'missed'}"


def table(rows: list[list], headers: list[str]) -> str:
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    out = []
    for j, r in enumerate(cells):
        out.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def _fmt(c) -> str:
    if isinstance(c, float):
        return f"{c:,.1f}" if abs(c) >= 100 else f"{c:.3f}"
    if isinstance(c, int):
        return f"{c:,}"
    return "-" if c is None else str(c)


def kv_line(results: dict) -> str:
    def v(x):
        if isinstance(x, float):
            return f"{x:.4g}" if abs(x) < 1e5 else f"{x:.0f}"
        return str(x).replace(" ", "_")

    return " ".join(f"{k}={v(x)}" for k, x in results.items())


def bare_run(spec: str, wd: Path, steps: int, precision: str, tag: str) -> dict:
    """benchmarks/_bare_loop.py under `torchrun --standalone --nproc_per_node=2` (1 thread per rank) with the
    config of `spec`: its BARE_RESULT, the time of its first optimizer step from launch and the run's wall."""
    env = clean_env()
    env["OMP_NUM_THREADS"] = "1"
    cmd = [
        PY,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(Path(__file__).resolve().parent / "_bare_loop.py"),
        "--spec",
        spec,
        "--steps",
        str(steps),
        "--precision",
        precision,
    ]
    p = run_lines(cmd, env, wd / f"bare-{tag}.log", timeout=900)
    res = next((json.loads(line.split(" ", 1)[1]) for _, line in p.lines if line.startswith("BARE_RESULT ")), None)
    if res is None:
        raise BenchError(f"bare loop {tag} printed no result; log {wd / f'bare-{tag}.log'}")
    step1 = next((t for t, line in p.lines if line.startswith("BARE_STEP1")), None)
    res.update(
        tag=tag,
        wall=p.wall,
        other_cores=p.other_cores,
        first_step_s_wall=step1,
        shape=f"{res['micro_batch_size']}x{res['seq_len']}x{res['world_size']}x{res['grad_accum_steps']}",
    )
    return res


@contextlib.contextmanager
def work_folder(prefix: str, keep: bool = False, what: str = "", path: Path | None = None) -> Iterator[Path]:
    """A benchmark's scratch folder (`path`, which must not exist yet, else a new temporary one): removed
    once the benchmark measured; kept, and named, when it failed (its logs say why), when `keep`
    (--keep) or when the user named it."""
    import tempfile

    if path is not None:
        path.mkdir(parents=True)
    wd = path or Path(tempfile.mkdtemp(prefix=f"ghostvis-bench-{prefix}-"))
    try:
        yield wd
    except BaseException:
        print(f"kept {wd}{what}", flush=True)
        raise
    if keep or path is not None:
        print(f"kept {wd}{what}")
    else:
        shutil.rmtree(wd, ignore_errors=True)


def main_wrapper(fn: Callable[[], int]) -> None:
    """Exit 0 when the benchmark measured (goals met or not), 1 when it could not."""
    try:
        sys.exit(fn())
    except BenchError as exc:
        print(f"benchmark error: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)

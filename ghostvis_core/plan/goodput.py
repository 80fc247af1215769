"""The goodput a planned run can expect under failures, and the checkpoint interval that maximizes it.

The model (docs/goodput-plan.md): a run computes `work_s` seconds of steps in segments of `interval_s` (the
checkpoint interval), each followed by a save that stops training for `save_s`; its last segment ends with the
final checkpoint. Failures strike the job as a Poisson process of mean `job_mtbf_s` at any moment (a step, a
save or a restart); each loses the work since the last committed checkpoint and costs a restart of
`restart_s` (process start to the first step after loading the checkpoint), itself open to failure. The job's
MTBF is the per-node MTBF over its nodes (ceil(GPUs / GPUs per node)): nodes fail independently.

Under this model the expected wall time of a segment of L seconds is exactly
M e^(R/M) (e^(L/M) - 1) (Daly 2006), and goodput = work_s / expected wall time. The interval recommended is
Daly's higher-order optimum, sqrt(2 d M) (1 + sqrt(d / 2M) / 3 + d / 18M) - d for d < 2M (else M), close to
Young's sqrt(2 d M). `simulate` draws the same model's failures, seeded, to check the formula.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass

from ghostvis_core.errors import GhostvisError


@dataclass(frozen=True)
class FailureModel:
    """What failures cost a run: save and restart seconds, and how often the job fails (seconds)."""

    save_s: float  # training stopped per checkpoint save
    restart_s: float  # a failure to the first step after the checkpoint is loaded again
    job_mtbf_s: float  # the whole job's mean time between failures


@dataclass(frozen=True)
class FailureFigures:
    """The figures a goodput plan is given, each with where it comes from (a flag, a run record, an assumption)."""

    node_mtbf_hours: float
    gpus_per_node: int
    save_s: float
    restart_s: float
    gpus_per_node_from: str
    save_from: str
    restart_from: str


def job_mtbf_hours(node_mtbf_hours: float, gpus: int, gpus_per_node: int) -> tuple[int, float]:
    """(nodes, the job's MTBF in hours): ceil(gpus / gpus_per_node) nodes failing independently, each with
    mean time between failures `node_mtbf_hours`."""
    nodes = math.ceil(gpus / gpus_per_node)
    return nodes, node_mtbf_hours / nodes


@dataclass(frozen=True)
class Segments:
    """A run cut at its checkpoints: `full` segments of `interval_s` of steps and a save, then the last one: what
    is left of the work, and the final save."""

    full: int
    length_s: float
    last_s: float

    def lengths(self) -> list[float]:
        return [self.length_s] * self.full + [self.last_s]


def segments(work_s: float, interval_s: float, save_s: float) -> Segments:
    n = max(1, math.ceil(work_s / interval_s - 1e-9))
    return Segments(n - 1, interval_s + save_s, work_s - (n - 1) * interval_s + save_s)


def expected_wall_s(work_s: float, interval_s: float, fm: FailureModel) -> float:
    """The expected wall time of `work_s` seconds of steps checkpointed every `interval_s` (Daly's exact
    expectation, summed over the segments)."""
    m, r = fm.job_mtbf_s, fm.restart_s
    seg = segments(work_s, interval_s, fm.save_s)
    try:
        return m * math.exp(r / m) * (seg.full * math.expm1(seg.length_s / m) + math.expm1(seg.last_s / m))
    except OverflowError:
        return math.inf  # failures come so much faster than a segment or a restart ends that the run never ends


def expected_goodput(work_s: float, interval_s: float, fm: FailureModel) -> float:
    """Seconds of kept steps over expected wall seconds."""
    return work_s / expected_wall_s(work_s, interval_s, fm)


def young_interval_s(fm: FailureModel) -> float:
    """Young's first-order optimum: sqrt(2 x save x MTBF)."""
    return math.sqrt(2 * fm.save_s * fm.job_mtbf_s)


def daly_interval_s(fm: FailureModel) -> float:
    """Daly's higher-order optimum of the checkpoint interval (steps between saves, in seconds)."""
    d, m = fm.save_s, fm.job_mtbf_s
    if d >= 2 * m:
        return m
    x = d / (2 * m)
    return math.sqrt(2 * d * m) * (1 + math.sqrt(x) / 3 + x / 9) - d


def _segment_wall_s(length: float, fm: FailureModel, rng: random.Random) -> tuple[float, int]:
    """One segment's simulated wall time and failures: retried after each failure and its restart."""
    rate, wall, failures = 1 / fm.job_mtbf_s, 0.0, 0
    while True:
        strike = rng.expovariate(rate)
        if strike >= length:
            return wall + length, failures
        wall, failures = wall + strike, failures + 1
        while (strike := rng.expovariate(rate)) < fm.restart_s:  # a failure during the restart restarts it
            wall, failures = wall + strike, failures + 1
        wall += fm.restart_s


@dataclass(frozen=True)
class Simulated:
    """A seeded Monte Carlo of the failure model: goodput's mean and standard error over the trials."""

    trials: int
    seed: int
    goodput_mean: float
    goodput_stderr: float
    failures_mean: float


def simulate(work_s: float, interval_s: float, fm: FailureModel, trials: int, seed: int) -> Simulated:
    """Draw `trials` runs of `work_s` seconds of steps checkpointed every `interval_s` under `fm`'s failures."""
    rng = random.Random(seed)
    lengths = segments(work_s, interval_s, fm.save_s).lengths()
    goodputs, failures = [], 0
    for _ in range(trials):
        runs = [_segment_wall_s(seg, fm, rng) for seg in lengths]
        goodputs.append(work_s / sum(w for w, _ in runs))
        failures += sum(f for _, f in runs)
    mean = sum(goodputs) / trials
    var = sum((g - mean) ** 2 for g in goodputs) / max(1, trials - 1)
    return Simulated(trials, seed, mean, math.sqrt(var / trials), failures / trials)


@dataclass(frozen=True)
class GoodputPlan:
    """The planned run under failures: its figures and their sources, its goodput at the configured checkpoint
    interval and at the recommended one (`checkpoint.every_steps` and `checkpoint.every_minutes`)."""

    figures: FailureFigures
    gpus: int
    nodes: int
    job_mtbf_hours: float
    step_time_s: float
    work_hours: float  # the planned steps x step time: wall clock without failures or saves
    configured_every_steps: int
    configured_interval_s: float
    configured_goodput: float
    young_interval_s: float
    daly_interval_s: float
    every_steps: int  # the recommendation, in steps of step_time_s
    every_minutes: float
    goodput: float  # expected at every_steps
    expected_failures: float  # over the run at every_steps: expected wall / job MTBF
    expected_hours: float  # expected wall clock at every_steps

    def to_dict(self) -> dict:
        return asdict(self)


def plan_goodput(
    figures: FailureFigures, gpus: int, steps: int, step_time_s: float, every_steps: int, every_minutes: float
) -> GoodputPlan:
    """The goodput plan of `steps` steps of `step_time_s` on `gpus` GPUs. The configured interval is the stage's
    checkpoint.every_steps, or checkpoint.every_minutes when that is sooner."""
    nodes, mtbf_h = job_mtbf_hours(figures.node_mtbf_hours, gpus, figures.gpus_per_node)
    fm = FailureModel(figures.save_s, figures.restart_s, mtbf_h * 3600)
    work_s = steps * step_time_s
    configured = every_steps * step_time_s
    if every_minutes > 0:
        configured = min(configured, every_minutes * 60)
    daly = daly_interval_s(fm)
    rec_steps = max(1, round(daly / step_time_s))
    wall = expected_wall_s(work_s, rec_steps * step_time_s, fm)
    if math.isinf(wall):
        raise GhostvisError(
            f"a job MTBF of {fm.job_mtbf_s:.3g} s against a {fm.restart_s:g} s restart and a {fm.save_s:g} s save: "
            f"failures come so much sooner than a restart or a checkpoint ends that the run is not expected to "
            f"finish; plan fewer GPUs, or check --mtbf-hours (per node) and --restart-seconds"
        )
    return GoodputPlan(
        figures=figures,
        gpus=gpus,
        nodes=nodes,
        job_mtbf_hours=mtbf_h,
        step_time_s=step_time_s,
        work_hours=work_s / 3600,
        configured_every_steps=every_steps,
        configured_interval_s=configured,
        configured_goodput=expected_goodput(work_s, configured, fm),
        young_interval_s=young_interval_s(fm),
        daly_interval_s=daly,
        every_steps=rec_steps,
        every_minutes=round(rec_steps * step_time_s / 60, 2),
        goodput=work_s / wall,
        expected_failures=wall / fm.job_mtbf_s,
        expected_hours=wall / 3600,
    )


def _seconds(s: float) -> str:
    """Seconds as the text prints them: whole above 10, else 3 significant digits (a tiny model's step)."""
    return f"{s:,.0f}" if s >= 10 else f"{s:.3g}"


def goodput_lines(g: GoodputPlan) -> list[str]:
    """`ghostvis plan --mtbf-hours`'s text: the failure figures, where each comes from, and the intervals."""
    f = g.figures
    return [
        f"  job MTBF        = {f.node_mtbf_hours:g} h per node / {g.nodes:,} nodes "
        f"(ceil({g.gpus:,} GPUs / {f.gpus_per_node} per node, {f.gpus_per_node_from})) = {g.job_mtbf_hours:.3f} h",
        f"  save            = {f.save_s:g} s  ({f.save_from})",
        f"  restart         = {f.restart_s:g} s  ({f.restart_from})",
        f"  goodput now     = {g.configured_goodput:.2%}  (a checkpoint every {_seconds(g.configured_interval_s)} s: "
        f"checkpoint.every_steps={g.configured_every_steps})",
        f"  interval        = {_seconds(g.daly_interval_s)} s (Daly; Young sqrt(2 x save x MTBF) = "
        f"{_seconds(g.young_interval_s)} s)",
        f"  recommended     = --set checkpoint.every_steps={g.every_steps} "
        f"(or checkpoint.every_minutes={g.every_minutes:g})",
        f"  goodput then    = {g.goodput:.2%}  ({g.work_hours:,.2f} h of steps in {g.expected_hours:,.2f} h expected, "
        f"{g.expected_failures:,.1f} failures expected)",
    ]

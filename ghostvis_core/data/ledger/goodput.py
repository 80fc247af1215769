"""Goodput of a run from its ledger: where the wall time of every launch went, from the launches' timelines
(`TimelineRow`s, ghostvis_core/run/train/timeline.py) and the run's chain of parts (which steps were kept).

Categories (docs/goodput.md): productive (the steps of the parts on the run's chain), redone (steps computed and
not kept: those of a part off the chain, and those a launch computed after its last commit), start-up, checkpoint
load, checkpoint save, evaluation, waiting (for the run identity's lease, on either side; between launches after a
preemption: the requeue), detection (a hang's timeout; between launches after a fault: the retry back-off),
unrecorded (a launch killed outright: its time after its last commit, which it could not write) and other (a
launch's time in none of these).

The wall is the launching side's: from the start of the step that made the first launch (its planning and lease
are start-up) to the last launch's end, on its host's monotonic clock. Two clocks are compared only when their
host's boot id is the same; otherwise only durations are added."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from ghostvis_core.data.ledger.records import PartRow, TimelineRow

if TYPE_CHECKING:
    from ghostvis_core.data.ledger import Ledger

CATEGORIES = (
    "productive",
    "redone",
    "startup",
    "checkpoint_load",
    "checkpoint_save",
    "evaluation",
    "waiting",
    "detection",
    "unrecorded",
    "other",
)
# a job row's kind -> its category (steps rows are productive or redone by the chain)
_KIND = {
    "startup": "startup",
    "load": "checkpoint_load",
    "save": "checkpoint_save",
    "eval": "evaluation",
    "lease_wait": "waiting",
    "detection": "detection",
}
# a gap between two launches, by how the first one ended
_GAP = {"preempted": "waiting", "completed": "waiting"}
# a launch whose rank 0 ended without a word (a signal, a lost node): the launching side's outcome of it
KILLED = "killed"


@dataclass(frozen=True)
class JobLaunch:
    """Rank 0's timeline of one launch: its rows, its wall (to its end row, else to its last row) and its end."""

    rows: tuple[TimelineRow, ...]

    @property
    def first(self) -> TimelineRow:
        return self.rows[0]

    @property
    def end(self) -> TimelineRow | None:
        return next((r for r in self.rows if r.kind == "end"), None)

    @property
    def wall_s(self) -> float:
        end = self.end
        return end.start_s if end else max(r.start_s + r.duration_s for r in self.rows)


@dataclass
class Goodput:
    """A run's wall time split into CATEGORIES (seconds), its steps and token slots kept and thrown away."""

    run_key: str
    stage: str
    wall_s: float = 0.0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    productive_steps: int = 0
    redone_steps: int = 0
    tokens_per_step: int = 0
    launches: int = 0
    unmeasured_gaps: int = 0  # gaps between launches on clocks that cannot be compared: not in the wall
    faults: list[FaultCost] = field(default_factory=list)  # per launch that ended without completing

    @property
    def goodput(self) -> float:
        return self.seconds["productive"] / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def tokens_once(self) -> int:
        """Token slots (tokens_per_step per step) of the steps kept: trained once."""
        return self.productive_steps * self.tokens_per_step

    @property
    def tokens_thrown_away(self) -> int:
        """Token slots of the steps computed and not kept."""
        return self.redone_steps * self.tokens_per_step

    def as_dict(self) -> dict:
        return {
            "run_key": self.run_key,
            "stage": self.stage,
            "wall_s": round(self.wall_s, 3),
            "goodput": round(self.goodput, 5),
            "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
            "productive_steps": self.productive_steps,
            "redone_steps": self.redone_steps,
            "tokens_per_step": self.tokens_per_step,
            "tokens_once": self.tokens_once,
            "tokens_thrown_away": self.tokens_thrown_away,
            "launches": self.launches,
            "unmeasured_gaps": self.unmeasured_gaps,
            "faults": [
                asdict(f) | {"seconds": round(f.seconds, 3), "unrecorded_s": round(f.unrecorded_s, 3)}
                for f in self.faults
            ],
        }

    def metrics(self) -> dict[str, float]:
        """The figures as MLflow metrics / Dagster metadata (`goodput/...`)."""
        out = {f"goodput/{k}_s": round(v, 3) for k, v in self.seconds.items()}
        return {
            "goodput/ratio": round(self.goodput, 5),
            "goodput/wall_s": round(self.wall_s, 3),
            **out,
            "goodput/redone_steps": self.redone_steps,
            "goodput/tokens_once": self.tokens_once,
            "goodput/tokens_thrown_away": self.tokens_thrown_away,
        }


def run_goodput(run_key: str, stage: str, rows: list[TimelineRow], chain: list[PartRow]) -> Goodput:
    """The run's goodput from its timeline rows and its chain of parts."""
    out = Goodput(run_key, stage, tokens_per_step=chain[-1].tokens_per_step if chain else 0)
    kept = {(p.segment, p.step_first, p.step_last) for p in chain}
    jobs = launches_of([r for r in rows if r.side == "job"])
    for job in jobs:
        add_job(out, job, kept)
    launcher = launch_rows(rows)
    matched = match_jobs(launcher, jobs)
    for launch in launcher:
        inside = matched.get(launch.launch_id, [])
        out.seconds["unrecorded" if was_killed(launch, inside) else "startup"] += outside_jobs_s(launch, inside)
    waits = [r for r in rows if r.side == "launcher" and r.kind == "lease_wait"]
    ahead = add_ahead(out, launcher, waits)
    out.wall_s = ahead + sum(r.duration_s for r in launcher) + add_gaps(out, launcher, waits)
    out.wall_s += add_finish(out, rows, launcher)
    outside = [j for j in jobs if not any(j in js for js in matched.values())]
    out.wall_s += sum(j.wall_s for j in outside) + add_gaps(out, [job_span(j) for j in outside])
    out.launches = len(launcher) or len(jobs)
    out.faults = fault_costs(rows, chain)
    return out


def ledger_goodput(ledger: Ledger, run_key: str) -> Goodput | None:
    """The run's goodput from the ledger's timeline and parts; None when no launch of it recorded a timeline."""
    rows = ledger.timeline([run_key])
    if not rows:
        return None
    return run_goodput(run_key, rows[0].stage, rows, ledger.chain(run_key))


def launch_rows(rows: list[TimelineRow]) -> list[TimelineRow]:
    """The launching side's `launch` rows, in the order they started (on one clock: by boot id, then time)."""
    launches = [r for r in rows if r.side == "launcher" and r.kind == "launch"]
    return sorted(launches, key=lambda r: (r.boot_id, r.origin_s + r.start_s))


def was_killed(launch: TimelineRow, inside: list[JobLaunch]) -> bool:
    """The launch was killed outright: the launching side says so, or a job in it wrote no end row."""
    return launch.reason == KILLED or any(j.end is None for j in inside)


def outside_jobs_s(launch: TimelineRow, inside: list[JobLaunch]) -> float:
    """A launch's time outside its jobs' rows: their processes' start and teardown, or, killed, also what the job
    did after its last row."""
    return launch.duration_s - sum(j.wall_s for j in inside)


def lease_waited(waits: list[TimelineRow], boot: str, lo: float, hi: float) -> float:
    """The seconds of the launching side's lease waits (`lease_wait` rows on the clock of `boot`) within [lo, hi]."""
    spans = [(w.origin_s + w.start_s, w.origin_s + w.start_s + w.duration_s) for w in waits if w.boot_id == boot]
    return sum(max(0.0, min(hi, end) - max(lo, start)) for start, end in spans)


def add_ahead(out: Goodput, launcher: list[TimelineRow], waits: list[TimelineRow]) -> float:
    """The first launching step's time before its first launch: its wait for the lease as waiting, the rest (its
    planning) as start-up."""
    if not launcher:
        return 0.0
    first = launcher[0]
    waited = lease_waited(waits, first.boot_id, first.origin_s, first.origin_s + first.start_s)
    out.seconds["waiting"] += waited
    out.seconds["startup"] += first.start_s - waited
    return first.start_s


def add_finish(out: Goodput, rows: list[TimelineRow], launcher: list[TimelineRow]) -> float:
    """The launching step's work after the last launch (its `finish` mark, on the same clock) as `other`."""
    marks = [r for r in rows if r.kind == "finish" and launcher and r.boot_id == launcher[-1].boot_id]
    if not marks:
        return 0.0
    last = launcher[-1]
    tail = max(0.0, max(r.origin_s + r.start_s for r in marks) - (last.origin_s + last.start_s + last.duration_s))
    out.seconds["other"] += tail
    return tail


def launches_of(rows: list[TimelineRow]) -> list[JobLaunch]:
    """The rows grouped by launch, each launch's by time."""
    by: dict[str, list[TimelineRow]] = {}
    for r in rows:
        by.setdefault(r.launch_id, []).append(r)
    return [JobLaunch(tuple(sorted(rs, key=lambda r: (r.start_s, r.kind)))) for rs in by.values()]


def add_job(out: Goodput, job: JobLaunch, kept: set[tuple[int, int, int]]) -> None:
    """One launch's rows into the categories; its time in none of them is `other`."""
    counted = 0.0
    for r in job.rows:
        if r.kind == "steps":
            keep = r.reason == "committed" and (r.segment, r.step_first, r.step_last) in kept
            out.seconds["productive" if keep else "redone"] += r.duration_s
            steps = r.step_last - r.step_first + 1
            out.productive_steps += steps if keep else 0
            out.redone_steps += 0 if keep else steps
        elif r.kind in _KIND:
            out.seconds[_KIND[r.kind]] += r.duration_s
        else:
            continue
        counted += r.duration_s
    out.seconds["other"] += job.wall_s - counted


def match_jobs(launcher: list[TimelineRow], jobs: list[JobLaunch]) -> dict[str, list[JobLaunch]]:
    """Each job launch under the launching side's launch it ran in: its start within the launch's span on the
    same clock (same boot id), else (another host's clock) its rows written within the launch's wall-clock span."""
    out: dict[str, list[JobLaunch]] = {}
    for job in jobs:
        for launch in launcher:
            if launch.boot_id == job.first.boot_id:
                start = launch.origin_s + launch.start_s
                inside = start <= job.first.origin_s <= start + launch.duration_s
            else:
                inside = launch.created_at - launch.duration_s <= job.first.created_at <= launch.created_at
            if inside:
                out.setdefault(launch.launch_id, []).append(job)
                break
    return out


def job_span(job: JobLaunch) -> TimelineRow:
    """A job launch as one row over its wall, ended as it ended (for the gaps between launches no launcher saw)."""
    f, end = job.first, job.end
    where = (f.run_key, f.stage, f.launch_id, "job", f.segment, f.host, f.boot_id, f.origin_s)
    ended = max(r.created_at for r in job.rows)
    return TimelineRow(*where, "launch", 0.0, job.wall_s, reason=end.reason if end else "failed", created_at=ended)


def add_gaps(out: Goodput, spans: list[TimelineRow], waits: list[TimelineRow] | None = None) -> float:
    """The time between consecutive launches on one clock (same boot id), as waiting after a preemption and as
    detection after a fault, but a retry's wait for the lease in it (`waits`), which is waiting; a gap across clocks
    cannot be measured and is counted in `unmeasured_gaps`."""
    total = 0.0
    ordered = sorted(spans, key=lambda r: r.created_at - r.duration_s)
    for before, after in zip(ordered, ordered[1:]):
        if before.boot_id != after.boot_id:
            out.unmeasured_gaps += 1
            continue
        ended, started = before.origin_s + before.start_s + before.duration_s, after.origin_s + after.start_s
        gap = max(0.0, started - ended)
        waited = min(gap, lease_waited(waits or [], before.boot_id, ended, started))
        out.seconds["waiting"] += waited
        out.seconds[_GAP.get(before.reason, "detection")] += gap - waited
        total += gap
    return total


@dataclass(frozen=True)
class FaultCost:
    """What one launch that did not complete cost the run: its time after its last kept work (steps not kept, the
    detection, what its job could not record, its teardown), the wait to the next launch, and that launch's restart
    (its processes' start, rank 0's start-up and checkpoint load); the steps and token slots computed and not kept.
    A launch killed outright (reason `killed`) could not say what it did after its last commit: that time is its
    `unrecorded_s` (in the cost), and the steps it computed in it are not known (not in `steps`)."""

    launch: int  # 1 for the run's first launch
    reason: str
    seconds: float
    steps: int
    tokens: int
    unrecorded_s: float = 0.0


def fault_costs(rows: list[TimelineRow], chain: list[PartRow]) -> list[FaultCost]:
    """Per launch the launching side saw end without completing, its `FaultCost`."""
    tokens_per_step = chain[-1].tokens_per_step if chain else 0
    kept = {(p.segment, p.step_first, p.step_last) for p in chain}
    launcher = launch_rows(rows)
    matched = match_jobs(launcher, launches_of([r for r in rows if r.side == "job"]))
    own = []
    for launch in launcher:
        g = Goodput(launch.run_key, launch.stage)
        for job in matched.get(launch.launch_id, []):
            add_job(g, job, kept)
        own.append(g)
    out = []
    for k, launch in enumerate(launcher[:-1]):
        if launch.reason == "completed":
            continue
        kept_s = sum(own[k].seconds[c] for c in ("productive", "startup", "checkpoint_load", "checkpoint_save"))
        after = launcher[k + 1]
        gap = after.origin_s + after.start_s - (launch.origin_s + launch.start_s + launch.duration_s)
        restart = restart_s(after, matched.get(after.launch_id, []), own[k + 1])
        lost = launch.duration_s - kept_s - own[k].seconds["evaluation"] + max(0.0, gap) + restart
        steps = own[k].redone_steps
        inside = matched.get(launch.launch_id, [])
        killed = was_killed(launch, inside)
        unrecorded = outside_jobs_s(launch, inside) if killed else 0.0
        reason = KILLED if killed else launch.reason
        out.append(FaultCost(k + 1, reason, lost, steps, steps * tokens_per_step, unrecorded_s=unrecorded))
    return out


def restart_s(launch: TimelineRow, jobs: list[JobLaunch], g: Goodput) -> float:
    """A launch's time to its first step: its processes' start (on the launching side's clock, when rank 0's is the
    same one), rank 0's start-up and checkpoint load."""
    spawn = 0.0
    if jobs and jobs[0].first.boot_id == launch.boot_id:
        spawn = jobs[0].first.origin_s - (launch.origin_s + launch.start_s)
    return max(0.0, spawn) + g.seconds["startup"] + g.seconds["checkpoint_load"]

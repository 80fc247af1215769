"""A stage's ranks as one Slurm job: the sbatch script (`srun torchrun` on every node, one c10d
rendezvous on the first node) and what the job's end state means for the run.

Text and tables only, no scheduler calls: ghostvis_pipeline/launchers/slurm.py submits the script,
follows the job and acts on `job_outcome`.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from typing import Literal

from ghostvis_core.errors import GhostvisError
from ghostvis_core.launch.cluster.torchrun_command import Rendezvous, node_grace_s, torchrun_command
from ghostvis_core.plan.config import RuntimeConfig
from ghostvis_core.runs.job_command import TRAINING_ENTRY


@dataclass
class SlurmJob:
    """What a stage's Slurm job asks for. Empty strings and zeros leave the cluster's defaults."""

    nodes: int = 1
    gpus_per_node: int = 0  # 0: CPU-only nodes (no --gpus-per-node)
    cpus_per_task: int = 8  # cores for one node's ranks (one srun task per node); threads per rank = this / ranks
    mem: str = ""  # memory per node, e.g. "200G"
    time: str = ""  # wall-clock limit, e.g. "24:00:00"; past it the job ends TIMEOUT and a retry resumes
    partition: str = ""
    account: str = ""
    qos: str = ""
    job_name: str = "ghostvis"
    extra_sbatch: list[str] = field(default_factory=list)  # more sbatch options, one per line: "--exclusive"
    setup: list[str] = field(default_factory=list)  # shell lines before srun: `module load ...`, a venv or container
    python: str = "python"  # the interpreter on the nodes once `setup` has run
    # the batch node's copy of the job's output; node-local is fine: the output travels through the store
    output: str = "/tmp/ghostvis-slurm-%j.out"
    rdzv_port: int = 29400  # the c10d rendezvous port on the job's first node
    poll_seconds: float = 5.0  # how often the launcher reads the job's state and output
    # No signal setting here: with a time limit, Slurm sends SIGTERM to each node's torchrun (the job step) the
    # stage's grace period (runtime.preempt_grace_s) plus torchrun's exit before the limit (`--signal=TERM@s`);
    # torchrun passes it to the ranks, which commit a checkpoint and exit `preempted`; the launcher resumes.


# Job states that end a job, and what they mean for the run. Slurm's other states (PENDING, RUNNING,
# COMPLETING, SUSPENDED, REQUEUED, ...) are not final; an unlisted final state counts as failed.
Outcome = Literal["ok", "resumable", "failed"]
JOB_OUTCOMES: dict[str, Outcome] = {
    "COMPLETED": "ok",
    "TIMEOUT": "resumable",
    "PREEMPTED": "resumable",
    "NODE_FAIL": "resumable",
    "FAILED": "failed",
    "CANCELLED": "failed",
    "OUT_OF_MEMORY": "failed",
    "BOOT_FAIL": "failed",
    "DEADLINE": "failed",
}
ACTIVE_STATES = {
    "PENDING",
    "CONFIGURING",
    "RUNNING",
    "COMPLETING",
    "SUSPENDED",
    "REQUEUED",
    "REQUEUE_FED",
    "REQUEUE_HOLD",
    "RESIZING",
    "SIGNALING",
    "STAGE_OUT",
    "STOPPED",
    "RESV_DEL_HOLD",
}

# Variables whose values must never be written into a script or a log; they reach the job through
# sbatch's own environment (--export=ALL) instead, or not at all (launcher send_credentials: false).
SECRET_NAME = re.compile(r"SECRET|TOKEN|PASSW|CREDENTIAL|PRIVATE|(^|_)KEY($|_)", re.IGNORECASE)
SHELL_VAR = re.compile(r"(\$\{?[A-Za-z_][A-Za-z0-9_]*\}?)")


def job_outcome(state: str) -> Outcome | None:
    """None while the job runs; sacct's "CANCELLED by 0" counts as CANCELLED."""
    name = state.split()[0].rstrip("+") if state.strip() else "PENDING"
    if name in ACTIVE_STATES:
        return None
    return JOB_OUTCOMES.get(name, "failed")


def is_secret(name: str) -> bool:
    return bool(SECRET_NAME.search(name))


def redact(text: str) -> str:
    """`NAME=value` with a secret-looking variable NAME (upper case, as environment variables are) shown as
    `NAME=***`, for logging scripts, environments and job output (where `tokens_per_step=4096` stays)."""
    return re.sub(
        r"\b([A-Z_][A-Z0-9_]*)=(\"[^\"]*\"|'[^']*'|\S+)", lambda m: f"{m[1]}=***" if is_secret(m[1]) else m[0], text
    )


def shell_word(arg: str) -> str:
    """`arg` quoted for bash, except its `$VAR` references, which the node expands."""
    return "".join(
        f'"{part}"' if SHELL_VAR.fullmatch(part) else shlex.quote(part) if part else "" for part in SHELL_VAR.split(arg)
    )


def sbatch_options(job: SlurmJob, grace_s: float) -> list[str]:
    """The `#SBATCH` lines: one srun task per node, which runs torchrun for that node's ranks; with a time limit,
    the stop signal early enough for a grace period of `grace_s`."""
    if job.nodes < 1:
        raise GhostvisError(f"slurm nodes={job.nodes}: a job needs at least 1 node; set launcher slurm.nodes")
    opts = [
        f"--job-name={job.job_name}",
        f"--nodes={job.nodes}",
        "--ntasks-per-node=1",
        f"--output={job.output}",
        "--export=ALL",
        "--no-requeue",
    ]  # the launcher follows one job to its end; it launches a preempted run again, a Dagster retry a failed one
    if job.time:
        opts.append(f"--signal=TERM@{node_grace_s(grace_s)}")
    named = {
        "--cpus-per-task": job.cpus_per_task,
        "--gpus-per-node": job.gpus_per_node,
        "--mem": job.mem,
        "--time": job.time,
        "--partition": job.partition,
        "--account": job.account,
        "--qos": job.qos,
    }
    opts += [f"{name}={value}" for name, value in named.items() if value]
    for extra in job.extra_sbatch:
        if not extra.startswith("-"):
            raise GhostvisError(
                f"slurm extra_sbatch entry {extra!r} is not an sbatch option; write it as "
                f"'--constraint=a100' (without '#SBATCH')"
            )
        opts.append(extra)
    return [f"#SBATCH {shlex.quote(opt)}" for opt in opts]


def ship_command(job: SlurmJob, store_uri: str, stage: str, run_key: str, name: str) -> list[str]:
    """The batch node's pipe that ships the job's output to the store (ghostvis_core/run/ship_output.py)."""
    return [
        job.python,
        "-m",
        "ghostvis_core.run.ship_output",
        "--store",
        store_uri,
        "--stage",
        stage,
        "--run-key",
        run_key,
        "--name",
        name,
    ]


def render_sbatch(
    job: SlurmJob,
    spec_uri: str,
    nproc_per_node: int,
    env: dict[str, str],
    ship: list[str],
    module: str = TRAINING_ENTRY,
    args: tuple[str, ...] = (),
    grace_s: float = RuntimeConfig.preempt_grace_s,
) -> str:
    """The job script: options, exported (non-secret) environment, setup lines, then one
    `srun torchrun` whose rendezvous is on the first node of the allocation, its output piped
    through `ship` (to the store, where the launcher reads it, and on to the `--output` file);
    `grace_s`: the stage's runtime.preempt_grace_s."""
    rendezvous = Rendezvous(nnodes="$SLURM_NNODES", endpoint=f"$rdzv_host:{job.rdzv_port}", rdzv_id="$SLURM_JOB_ID")
    torchrun = torchrun_command(
        spec_uri, nproc_per_node, rendezvous, python=job.python, module=module, args=args, grace_s=grace_s
    )
    exports = [f"export {name}={shlex.quote(value)}" for name, value in sorted(env.items()) if not is_secret(name)]
    return "\n".join(
        [
            "#!/bin/bash",
            *sbatch_options(job, grace_s),
            "set -eo pipefail",
            *exports,
            *job.setup,
            "{",
            "# the first node hosts the rendezvous; its NodeAddr is how the other nodes reach it",
            'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
            'head_addr=$(scontrol -o show node "$head_node" | grep -o "NodeAddr=[^ ]*" | cut -d= -f2)',
            'rdzv_host="${head_addr:-$head_node}"',
            "srun --kill-on-bad-exit=1 " + " ".join(shell_word(arg) for arg in torchrun),
            "} 2>&1 | " + shlex.join(ship),
            "",
        ]
    )

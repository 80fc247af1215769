"""The torchrun command line that starts a run's ranks: one node (--standalone) or several (c10d rendezvous).

torchrun forwards every stop signal a cluster or a user sends (STOP_SIGNALS: Kubernetes' and Slurm's SIGTERM,
Slurm's `--signal=USR1@...`, Ctrl-C's SIGINT) to its ranks, which take each as a preemption (a checkpoint of
the step they are at), and waits the stage's grace period (`runtime.preempt_grace_s`) for them before SIGKILL.
"""

from __future__ import annotations

import math
import os
import shlex
import socket
import sys
from dataclasses import dataclass, field

from ghostvis_core.errors import GhostvisError
from ghostvis_core.plan.config import STOP_SIGNALS, RuntimeConfig
from ghostvis_core.runs.job_command import TRAINING_ENTRY

# The node agent every launcher runs: torchrun itself, ending a failed rank's report in one line (run/elastic_agent.py)
AGENT_MODULE = "ghostvis_core.run.elastic_agent"

# What a node (a pod, a Slurm step) is given beyond torchrun's wait for its ranks: torchrun's own exit after theirs
SHUTDOWN_MARGIN_S = 10


def shutdown_timeout(grace_s: float) -> int:
    """torchrun's --shutdown-timeout for a grace period: whole seconds (torchrun takes an int), at least 1."""
    return max(1, math.ceil(grace_s))


def node_grace_s(grace_s: float) -> int:
    """Seconds a node gets between its stop signal and the kill (Kubernetes' terminationGracePeriodSeconds, how
    long before its time limit Slurm signals): torchrun's wait for its ranks, then torchrun's own exit."""
    return shutdown_timeout(grace_s) + SHUTDOWN_MARGIN_S


@dataclass(frozen=True)
class Rendezvous:
    """How the nodes of a multi-node run find each other (torchrun's c10d rendezvous)."""

    nnodes: int | str  # a count, or a variable the node's shell expands ("$SLURM_NNODES")
    endpoint: str  # host:port of the rendezvous store (the first node's address)
    rdzv_id: str  # the same on every node of one run; a new one for every launch
    # No node rank: the c10d rendezvous ignores --node-rank and numbers the nodes by sorting them
    # (host name, then process id; torch/distributed/elastic/rendezvous/dynamic_rendezvous.py).


def torchrun_command(
    spec_uri: str,
    nproc_per_node: int,
    rendezvous: Rendezvous | None = None,
    python: str | None = None,
    module: str = TRAINING_ENTRY,
    args: tuple[str, ...] = (),
    grace_s: float = RuntimeConfig.preempt_grace_s,
) -> list[str]:
    """`python -m ghostvis_core.run.elastic_agent ... -m <module> --spec <spec_uri> <args>` (torchrun as
    AGENT_MODULE; the job's module: training's, the evaluation's, registration's); without a rendezvous: one node,
    rendezvous on a free local port. The
    STOP_SIGNALS reach the ranks, and torchrun waits `grace_s` (the stage's runtime.preempt_grace_s) for them."""
    if rendezvous is None:
        nodes = ["--standalone"]
    else:
        nodes = [
            f"--nnodes={rendezvous.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={rendezvous.endpoint}",
            f"--rdzv-id={rendezvous.rdzv_id}",
        ]
    return [
        python or sys.executable,
        "-m",
        AGENT_MODULE,
        *nodes,
        f"--nproc_per_node={nproc_per_node}",
        f"--signals-to-handle={','.join(STOP_SIGNALS)}",
        f"--shutdown-timeout={shutdown_timeout(grace_s)}",
        "-m",
        module,
        "--spec",
        spec_uri,
        *args,
    ]


def worker_env(nproc_per_node: int, cpus: int | None = None) -> dict[str, str]:
    """Threads per rank: the node's cores shared evenly (torchrun would default to 1 and warn)."""
    threads = max(1, (cpus or os.cpu_count() or 1) // nproc_per_node)
    return {"OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}


RDZV_PORT = 29400  # torchrun's usual c10d port; open it on the rendezvous host


@dataclass
class MultiNode:
    """A multi-node torchrun launch on machines started by hand or by another scheduler: the Dagster
    host is one of the nodes; the others run the same command (torchrun ranks the nodes by host name)."""

    nnodes: int = 2
    rdzv_endpoint: str = ""  # host:port every node reaches; "": this host's name, port RDZV_PORT
    rdzv_id: str = ""  # "": the run key and launch attempt, so a new launch never joins a stale rendezvous
    hosts: list[str] = field(default_factory=list)  # the other nodes; empty: start them by hand
    node_shell: str = "ssh {host}"  # runs one shell command line (appended as the last argument) on {host}
    cpus_per_node: int = 0  # cores of each node, shared by its ranks as threads; 0: this host's count

    def check(self) -> None:
        """Refuse a launch that could only hang at the rendezvous."""
        if self.nnodes < 2:
            raise GhostvisError(
                f"torchrun launcher: nnodes={self.nnodes}; a multi-node run needs nnodes >= 2 "
                "(use launcher kind 'local' for one node)"
            )
        if self.hosts and len(self.hosts) != self.nnodes - 1:
            raise GhostvisError(
                f"torchrun launcher: hosts lists {len(self.hosts)} node(s) but nnodes={self.nnodes} "
                f"needs the {self.nnodes - 1} other node(s) (this host is one); list them all, or "
                "none to start them by hand"
            )
        try:
            self.node_argv("host", "true")
        except (KeyError, IndexError, ValueError) as exc:
            raise GhostvisError(
                f"torchrun launcher: node_shell '{self.node_shell}' is not a command template "
                f"({exc!r}); write e.g. 'ssh {{host}}', with {{host}} as the only placeholder"
            ) from None

    def rendezvous(self, run_key: str, attempt: str) -> Rendezvous:
        endpoint = self.rdzv_endpoint or f"{socket.gethostname()}:{RDZV_PORT}"
        return Rendezvous(self.nnodes, endpoint, self.rdzv_id or f"{run_key}-{attempt}")

    def node_argv(self, host: str, line: str) -> list[str]:
        """The local command that runs shell command `line` on node `host` through node_shell."""
        return [*(part.format(host=host) for part in shlex.split(self.node_shell)), line]


def node_line(command: list[str], env: dict[str, str]) -> str:
    """One shell command line that runs `command` with `env` on another node; `exec`, so that stopping
    the node shell (e.g. the ssh session) stops torchrun itself."""
    assigns = [f"{k}={v}" for k, v in sorted(env.items())]
    return shlex.join(["exec", "env", *assigns, *command])

"""The torchrun command line that starts a run's ranks: one node (--standalone) or several (c10d rendezvous)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Rendezvous:
    """How the nodes of a multi-node run find each other (torchrun's c10d rendezvous)."""

    nnodes: int
    endpoint: str  # host:port of the rendezvous store (the first node's address)
    rdzv_id: str  # the same on every node of one run; a new one for every launch
    node_rank: str = ""  # "": torchrun assigns ranks on arrival; "$SLURM_NODEID" etc. on a scheduler


def torchrun_command(spec_uri: str, nproc_per_node: int, rendezvous: Rendezvous | None = None,
                     python: str | None = None) -> list[str]:
    """`python -m torch.distributed.run ... -m ghostvis_core.train --spec <spec_uri>`; without a
    rendezvous: one node, rendezvous on a free local port."""
    if rendezvous is None:
        nodes = ["--standalone"]
    else:
        nodes = [f"--nnodes={rendezvous.nnodes}", "--rdzv-backend=c10d",
                 f"--rdzv-endpoint={rendezvous.endpoint}", f"--rdzv-id={rendezvous.rdzv_id}"]
        if rendezvous.node_rank:
            nodes.append(f"--node-rank={rendezvous.node_rank}")
    return [python or sys.executable, "-m", "torch.distributed.run", *nodes,
            f"--nproc_per_node={nproc_per_node}", "-m", "ghostvis_core.train", "--spec", spec_uri]


def worker_env(nproc_per_node: int, cpus: int | None = None) -> dict[str, str]:
    """Threads per rank: the node's cores shared evenly (torchrun would default to 1 and warn)."""
    threads = max(1, (cpus or os.cpu_count() or 1) // nproc_per_node)
    return {"OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}

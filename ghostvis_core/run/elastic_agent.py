"""torchrun, the node agent every launcher starts for a job (launch/cluster/torchrun_command.py): torch's own
`torch.distributed.run`, run in this process, with one change. When a rank fails, torchrun ends with its Python
trace and a root-cause table around torch's frames; the rank has already said what failed (`error: ...` on its
stderr, its reason in the run's files, which the launcher reports as the step's failure), so here that ending is
one line naming the rank, its host and exit code. Everything else (arguments, signals, exit codes, the ranks'
environment) is torchrun's. GHOSTVIS_DEBUG=1 keeps torchrun's own report."""

from __future__ import annotations

import os
import socket
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun_main

from ghostvis_core.errors import DEBUG_ENV


def failed_rank_line(exc: ChildFailedError) -> str:
    """torchrun's root cause in one line: the first rank that failed, where, and how it ended."""
    rank, failure = exc.get_first_failure()
    how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
    return (
        f"torchrun: {exc.name}: rank {rank} (local rank {failure.local_rank}, pid {failure.pid} on "
        f"{socket.gethostname()}) ended with {how}; its own error is above ({DEBUG_ENV}=1 shows torchrun's report)"
    )


def main(argv: list[str] | None = None) -> int:
    try:
        torchrun_main(argv)
    except ChildFailedError as exc:
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        print(failed_rank_line(exc), file=sys.stderr, flush=True)
        return 1  # what torchrun's uncaught ChildFailedError exits with
    return 0


if __name__ == "__main__":
    sys.exit(main())

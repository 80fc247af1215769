"""A process's exit without the interpreter's last garbage collections.

When the interpreter finalizes, it collects every object still alive. In a process that imported torch,
Dagster, MLflow or transformers that walk keeps the process alive after its last line: a rank after registering
its model, and `dagster asset materialize`, between its run's end and its exit (docs/architecture.md, "Fixed
costs", has the figures). Frozen objects are skipped; exit handlers still run, and what a process wrote is
closed and flushed by then.
"""

from __future__ import annotations

import atexit
import gc


def skip_final_collections() -> None:
    """Freeze every object at exit (an exit handler; registering it again replaces it)."""
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)

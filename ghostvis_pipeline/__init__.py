"""GhostVis's Dagster layer. Every process that loads it (the Dagster CLI, webserver, daemon and run workers,
the `ghostvis` CLI) exits without the interpreter's last garbage collections (ghostvis_core/exit.py)."""

from ghostvis_core.exit import skip_final_collections

skip_final_collections()

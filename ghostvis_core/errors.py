"""One exception type for bad input: its message names the thing and the fix.

CLIs print these without a traceback; Dagster shows them as the failure reason.
"""

# Set (to anything but 0), failures keep their Python traces on the console: Dagster's, and torchrun's of a failed
# rank (ghostvis_core/run/elastic_agent.py); without it a failure ends with GhostVis's message alone.
DEBUG_ENV = "GHOSTVIS_DEBUG"


class GhostvisError(Exception):
    """Bad input or state the user can fix; the message says how."""


class TransferError(GhostvisError):
    """A transfer that came back damaged (a download whose checksum disagrees): the next attempt may not meet it,
    so a job that raises it ends as a fault, which the stage's retry launches again."""

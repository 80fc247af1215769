"""One exception type for bad input: its message names the thing and the fix.

CLIs print these without a traceback; Dagster shows them as the failure reason.
"""


class GhostvisError(Exception):
    """Bad input or state the user can fix; the message says how."""

"""One `ghostvis` subcommand's parser: its name and help, the function that runs it, `--debug` (a failure
shows its traceback, not only GhostVis's message) and `--json` for the commands that can print JSON instead
of text (ledger, audit, status, trace)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def subcommand(sub, name: str, *, fn: Callable[[argparse.Namespace], int], json: bool = False, **parser: Any):
    """`sub.add_parser(name, **parser)`, run by `fn(args)`; json: with the `--json` flag. The caller adds the
    command's own arguments to the parser it returns."""
    p = sub.add_parser(name, **parser)
    p.add_argument("--debug", action="store_true", help="on a failure, show Python's traceback after the message")
    if json:
        p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(fn=fn)
    return p

"""`ghostvis store cat <uri>`: print a run's file (a job script, nodes.sh, a manifest, the spec) from
any store, so that what a launcher logged by its URI can be fetched and run on a node that shares no
folder with the Dagster host: `ghostvis store cat s3://bucket/runs/pretrain/<run key>/torchrun/nodes.sh | sh`."""

from __future__ import annotations

import sys

from ghostvis_core.runs.file_uri import read_run_file


def cmd_store_cat(args) -> int:
    sys.stdout.write(read_run_file(args.uri))
    return 0


def add_parser(sub) -> None:
    s = sub.add_parser("store", help="read a run's files from the artifact store (a folder or s3://)")
    actions = s.add_subparsers(dest="store_cmd", required=True)
    cat = actions.add_parser(
        "cat", help="print a run's file by the URI a launcher logged (<store>/runs/<stage>/<run_key>/<name>)"
    )
    cat.add_argument("uri")
    cat.set_defaults(fn=cmd_store_cat)

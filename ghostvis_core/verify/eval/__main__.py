"""The evaluation job, launched by the `evaluation` asset through the same launcher as training (local
torchrun, Slurm, Kubernetes; Pipes carries its log lines to Dagster):

    python -m ghostvis_core.verify.eval --spec <store>/runs/evaluation/<identity>/spec.json

It scores every stage of the spec's lineage (ghostvis_core/verify/eval/scoring.py) and writes the scores to
reports/evaluation/<identity>.json, which the asset reads and checks; a failure leaves its reason where the
launcher reads a rank's (ghostvis_core/runs/reasons.py).
"""

from __future__ import annotations

import json
import sys

from ghostvis_core.errors import GhostvisError
from ghostvis_core.run.track.pipes import PipesReporter
from ghostvis_core.runs.file_uri import split_run_uri
from ghostvis_core.runs.job_command import job_parser
from ghostvis_core.runs.reasons import record_reason
from ghostvis_core.store import open_store
from ghostvis_core.verify.eval.eval_spec import EVAL_FOLDER, MODULE, EvalSpec, results_name


def read_spec(uri: str) -> EvalSpec:
    """The spec at <store>/runs/evaluation/<identity>/spec.json, read through its store (a folder or s3://)."""
    store_uri, folder, key, name = split_run_uri(uri)
    if folder != EVAL_FOLDER or name != "spec.json":
        raise GhostvisError(f"--spec {uri}: expected <store>/runs/{EVAL_FOLDER}/<identity>/spec.json")
    return EvalSpec.from_dict(open_store(store_uri).read_json("run_spec", folder, key))


def main(argv: list[str] | None = None) -> int:
    ap = job_parser(MODULE, __doc__, "the evaluation's spec, as the asset wrote it: its URI in the store")
    args = ap.parse_args(argv)
    try:
        spec = read_spec(args.spec)
    except GhostvisError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    store, pipes = open_store(spec.store), PipesReporter(is_main=True)

    def log(message: str) -> None:
        print(message, flush=True)
        pipes.log(message)

    from ghostvis_core.verify.eval.scoring import evaluate  # torch, lm_eval: after the spec was found

    try:
        results = evaluate(spec, store, log)
        store.write_text("report", results_name(spec.key), text=json.dumps(results, indent=2))
    except BaseException as exc:
        record_reason(store, EVAL_FOLDER, spec.key, 0, f"{type(exc).__name__}: {exc}")
        raise
    finally:
        pipes.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

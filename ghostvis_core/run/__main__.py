"""Training entry point, the same under plain torchrun and under Dagster Pipes:

    torchrun --standalone --nproc_per_node=2 -m ghostvis_core.run --spec <store>/runs/<stage>/<run_key>/spec.json

The job only runs specs: a spec is planned and saved on the launching side (the pipeline's launchers, or
`ghostvis prepare <stage>`, which prints this line for it).

Rank 0 runs the pre-flight before the first step (ghostvis_core/run/preflight.py) and, once training
returned, registers the stage's model in MLflow (ghostvis_core/run/hf/register.py): the heavy parts of
a stage run happen here, wherever the job runs (torchrun, Slurm, Kubernetes, Pipes), never on the host
that launched it.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

from ghostvis_core.errors import GhostvisError, TransferError
from ghostvis_core.exit import skip_final_collections
from ghostvis_core.run.preflight import check_run
from ghostvis_core.run.train import dist
from ghostvis_core.run.train.dist import print0
from ghostvis_core.run.train.loop import train
from ghostvis_core.run.train.preemption import PREEMPTED_EXIT, Preempted
from ghostvis_core.runs.file_uri import split_run_uri
from ghostvis_core.runs.launch_spec import LaunchSpec
from ghostvis_core.runs.lookup import completed, identity_of
from ghostvis_core.runs.reasons import LEASE_LOST, LEASE_LOST_EXIT, record_reason
from ghostvis_core.store import lease, open_store
from ghostvis_core.store.fence import LeaseLost


def _leave_reason(spec, rank: int, reason: str, fault: bool = True) -> None:
    """This rank's reason, for the launcher (artifact run_error of this run and rank); `fault=False`: a problem
    of the run's inputs or settings, which the launcher does not retry."""
    if isinstance(spec, LaunchSpec):
        record_reason(open_store(spec.store), spec.stage, spec.run_key, rank, reason, fault=fault)


def check_spec(spec: LaunchSpec, ctx: dist.DistContext) -> None:
    """Rank 0's pre-flight of the spec (every rank waits for it to pass, or for its refusal)."""
    verdict = None
    if ctx.is_main:
        try:
            check_run(spec, open_store(spec.store))
            print(f"pre-flight of run {spec.run_key} passed (pid {os.getpid()} on {socket.gethostname()})", flush=True)
        except GhostvisError as exc:
            verdict = exc
    verdict = dist.broadcast_object(verdict, ctx)
    if verdict is not None:
        raise verdict


def hold_lease(spec: LaunchSpec, ctx: dist.DistContext) -> tuple[bool, lease.Lease | None]:
    """Rank 0 keeps the run identity's lease alive while the job trains: the lease its launcher took (joined,
    beaten here too, so a job that outlives its launcher keeps it), or, launched by hand, one it takes itself,
    waiting for another launch of the same identity to finish. Every commit of the run is fenced by it
    (store/fence.py). (done, lease): done on every rank when that launch completed the run meanwhile (nothing
    is left to train); the lease on rank 0."""
    held = None
    if ctx.is_main:
        store = open_store(spec.store)
        name = identity_of(spec.run_key)
        held = lease.join(store, spec.stage, name)
        if held is None:
            held = lease.acquire(
                store,
                spec.stage,
                name,
                holder={"run_key": spec.run_key},
                expiry_s=spec.config.runtime.lease_expiry_s,
                log=print,
            )
            if completed(store, spec.stage, spec.run_key):
                print(f"run {spec.run_key} was completed by another launch while this one waited", flush=True)
                held.release()
                held = None
        if held is not None:
            held.keep_alive()
    return dist.broadcast_object(ctx.is_main and held is None, ctx), held


def register_model(spec: LaunchSpec, held: lease.Lease) -> None:
    """The run's model in MLflow's registry, from rank 0 (not for a variant: it is compared, not promoted), granted
    through the run's lease first: a launch that lost the lease registers nothing."""
    if "ghostvis.variant" in spec.tags:
        return
    from ghostvis_core.run.hf.register import register_run  # after training: its imports are not paid before step 1

    record = register_run(spec, open_store(spec.store), spec.mlflow_tracking_uri, held)
    told = record.get("error") or f"{record['model_uri']} -> version {record['version']}"
    print(f"model of run {spec.run_key} (pid {record['pid']} on {record['host']}): {told}", flush=True)


def read_spec(uri: str) -> LaunchSpec:
    """The spec at <store>/runs/<stage>/<run_key>/spec.json, read through its store (a folder or s3://)."""
    store_uri, stage, run_key, name = split_run_uri(uri)
    if name != "spec.json":
        raise GhostvisError(f"--spec {uri}: expected <store>/runs/<stage>/<run_key>/spec.json")
    return LaunchSpec.read(open_store(store_uri), stage, run_key)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m ghostvis_core.run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--spec",
        required=True,
        help="launch spec written by the pipeline or `ghostvis prepare`: its path or URI in the store",
    )
    args = ap.parse_args(argv)
    # MLflow's HTTP client fails fast in this process, however it was launched: the tracker keeps its
    # own buffer and retries, so an outage costs a gap in delivery, not minutes of blocked retries.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    try:
        spec = read_spec(args.spec)
    except GhostvisError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    # collectives time out at twice the hang timeout: the watchdog (train/watchdog.py) names the hang first
    ctx = dist.setup(timeout_s=2 * spec.config.runtime.hang_timeout_s)
    held = None
    try:
        done, held = hold_lease(spec, ctx)
        if done:
            return 0
        check_spec(spec, ctx)
        train(spec, ctx, held)
        if ctx.is_main:
            register_model(spec, held)
    except Preempted as exc:  # every rank: the checkpoint is committed, the launcher launches again
        print0(f"[{spec.stage}] {exc}", ctx=ctx)
        _leave_reason(spec, ctx.rank, str(exc))
        return PREEMPTED_EXIT
    except LeaseLost as exc:  # every rank: nothing was committed after the loss; the new holder goes on
        print0(f"[{spec.stage}] error: {LEASE_LOST}: {exc}", ctx=ctx, file=sys.stderr, flush=True)
        _leave_reason(spec, ctx.rank, f"{LEASE_LOST}: {exc}")
        return LEASE_LOST_EXIT
    except GhostvisError as exc:  # every rank that met it (a token block may be read by one rank only)
        if ctx.is_main:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        _leave_reason(spec, ctx.rank, str(exc), fault=isinstance(exc, TransferError))
        return 2
    except BaseException as exc:
        _leave_reason(spec, ctx.rank, f"{type(exc).__name__}: {exc}")
        raise
    finally:
        if held is not None:
            held.release() if held.owned else held.stop()
        dist.teardown()
    return 0


if __name__ == "__main__":
    skip_final_collections()  # rank 0 would stay alive after registering its model, holding up torchrun's exit
    sys.exit(main())

"""Training stage assets, one per entry of the stage table: each materialization plans a run, writes its
launch spec, launches the job and maps what the job left in the store (its RunResult, its pre-flight's
budget, its registered model) to metadata. The heavy parts run in the job: the pre-flight (it builds
the objective) and the model's export and registration in MLflow; this process only plans, launches
and checks."""

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

from dagster import (
    AssetExecutionContext,
    Backoff,
    Config,
    DagsterExecutionInterruptedError,
    DataVersion,
    Failure,
    MaterializeResult,
    MetadataValue,
    RetryPolicy,
    StaticPartitionsDefinition,
    asset,
)

from ghostvis_core.data.ledger import Ledger
from ghostvis_core.errors import GhostvisError
from ghostvis_core.home import Home
from ghostvis_core.identity import code_version
from ghostvis_core.launch.start import TRAINING_MODULES, PlannedRun, plan_run, start_run
from ghostvis_core.plan import presets, selected
from ghostvis_core.plan.stages import Stage
from ghostvis_core.run.hf.register import model_record
from ghostvis_core.run.track.mlflow_models import alias_on_run
from ghostvis_core.run.train.timeline import now_s, record_lease_wait, recorded_launch
from ghostvis_core.runs.launch_spec import LaunchSpec
from ghostvis_core.runs.lookup import Upstream, run_result
from ghostvis_core.runs.preflight_findings import preflight_record
from ghostvis_core.runs.reasons import input_problem, lost_lease, run_reason, was_preempted
from ghostvis_core.runs.run_result import RunResult
from ghostvis_core.store import Store
from ghostvis_core.store.lease import Lease
from ghostvis_core.verify.audit.invariants import StageRun
from ghostvis_core.verify.audit.reward_signal import unrewarded_note
from ghostvis_core.verify.audit.stage_checks import stage_check_names
from ghostvis_pipeline.cache import cached_stage_run, changed_since
from ghostvis_pipeline.goodput_metadata import goodput_metadata
from ghostvis_pipeline.launchers import Launcher
from ghostvis_pipeline.launchers.common import CANCELLED, frozen_watch, registration_job, training_job
from ghostvis_pipeline.leases import run_lease
from ghostvis_pipeline.metadata import latest_metadata, md_table
from ghostvis_pipeline.resources import GhostvisHome


class StageRunConfig(Config):
    """Preset name plus dotted overrides of the stage config, e.g. {"budget.steps": 50}."""

    preset: str = ""  # empty: GHOSTVIS_PRESET, else selected.DEFAULT_PRESET (read when the run starts)
    # dotted key -> value as typed in YAML (30, 1e-3, true, muon) or as `--set` gives it ("30"): both
    # resolve alike (ghostvis_core.plan.config.apply_overrides)
    overrides: dict[str, Any] = {}
    # source -> weight (normalised); empty: the preset's recipe, else every registered source of the stage's kind
    recipe: dict[str, float] = {}
    val_sources: list[str] = []  # empty: the recipe's sources that have validation shards
    # true: train even when a completed run of the same identity passed its checks (a new attempt, its own MLflow run)
    force: bool = False
    # false: when another launch holds this run identity's lease (it is training it now), fail at once naming
    # that launch instead of waiting for it to finish and returning its run (a cache hit)
    wait: bool = True


def mlflow_ui() -> str:
    return os.environ.get("GHOSTVIS_MLFLOW_UI", "http://127.0.0.1:5000").rstrip("/")


def mlflow_url(experiment_id: str, run_id: str) -> str:
    """The run's page, in MLflow's model-training view (MLflow 3.17's UI takes the view from this query
    parameter, else from the browser's last choice, GenAI by default)."""
    return f"{mlflow_ui()}/#/experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning"


def result_metadata(r: RunResult) -> dict:
    """The run's figures: the four token counts, the batch factors, losses, evidence, mixture."""
    md: dict = {k: MetadataValue.int(v) for k, v in {**r.counts.as_dict(), **r.batch.to_dict()}.items()}
    md |= {
        "planned_tokens": MetadataValue.int(r.planned_tokens),
        "steps": MetadataValue.int(r.steps),
        "segment": MetadataValue.int(r.segment),
    }
    md |= {k: MetadataValue.int(v) for k, v in r.generated.items()}  # rl: generated/rewarded tokens, completions
    floats = {
        "train_loss": r.train_loss,
        "val_loss": r.val_loss,
        "val_loss_start": r.val_loss_start,
        "tokens_per_sec": r.tokens_per_sec,
        "first_step_s": r.first_step_s,
        "wall_time_s": r.wall_time_s,
        "mfu": r.mfu,
        "flops_per_token": r.flops_per_token,
        "peak_flops": r.peak_flops,
        "cuda_peak_memory_gb": r.cuda_peak_memory_gb,
    }
    md |= {k: MetadataValue.float(float(v)) for k, v in floats.items() if v is not None}
    if r.peak_source:
        md["peak_flops_source"] = r.peak_source
    for name, e in r.evidence.items():
        md[f"{name}_after"] = MetadataValue.float(e.after)
        if e.before is not None:
            md[f"{name}_before"] = MetadataValue.float(e.before)
    for source, m in r.mixture.items():
        md |= {
            f"mixture/{source}/fraction": MetadataValue.float(m.fraction),
            f"mixture/{source}/weight": MetadataValue.float(m.weight),
            f"mixture/{source}/tokens": MetadataValue.float(float(m.tokens)),
        }
    if r.frozen is not None:
        md |= {
            "frozen_params_sha256_before": r.frozen.sha256_before,
            "frozen_params_sha256_after": r.frozen.sha256_after,
            "frozen_params_unchanged": MetadataValue.float(float(r.frozen.unchanged)),
        }
    return md


def lineage_metadata(r: RunResult, spec: LaunchSpec, store: Store) -> dict:
    """Where the run lives and what it came from: run key, MLflow run, checkpoint (where the store is
    now, also for a run made before the store moved), tokenizer, upstream."""
    checkpoint = store.uri_of("checkpoint", r.stage, r.run_key, r.checkpoint_uri.rstrip("/").rsplit("/", 1)[-1])
    md = {
        "run_key": spec.run_key,
        "mlflow_run_id": r.mlflow_run_id,
        "mlflow_url": MetadataValue.url(mlflow_url(r.mlflow_experiment_id, r.mlflow_run_id)),
        "checkpoint_uri": MetadataValue.path(checkpoint),
        "tokenizer_id": spec.tokenizer_id,
    }
    if spec.parent_run_key:
        md |= {"parent_run_key": spec.parent_run_key, "init_checkpoint": MetadataValue.path(spec.init_checkpoint or "")}
    found = preflight_record(store, spec.stage, spec.run_key)  # what the job's pre-flight measured
    budget = found.source_budget if found else {}
    md["source_budget"] = MetadataValue.md(
        md_table(
            ["source", "needed_tokens", "available_tokens", "shards", "epochs"],
            [[s, b.needed_tokens, b.available_tokens, b.shards, b.epochs] for s, b in budget.items()],
        )
    )
    return md


def ledger_metadata(ledger: Ledger, run_key: str) -> dict:
    """The run's segments and the shard ranges it consumed, from the ledger."""
    segs = ledger.segments(run_key)
    consumed = ledger.consumed_by_shard(run_key)
    return {
        "segments": MetadataValue.md(
            md_table(
                ["segment", "steps", "world_size", "real_tokens"],
                [[g.segment, f"{g.first_step}..{g.last_step}", g.world_size, g.real_tokens] for g in segs],
            )
        ),
        "segment_count": len(segs),
        "shards_consumed": MetadataValue.md(
            md_table(
                ["shard", "split", "tokens", "rows", "epochs"],
                [[r.shard_id, r.split, r.tokens, r.rows, r.epochs] for r in consumed],
            )
        ),
    }


@contextmanager
def _terminated_not_retried(context, stage: Stage) -> Iterator[None]:
    """Around _materialize: a terminated Dagster run ends the step without a retry. Dagster raises
    DagsterExecutionInterruptedError in the step; the launcher stops the job and lets it go on up,
    and here it becomes a Failure that is not retried: the RetryPolicy would retry the interrupt itself
    (dagster's op_execution_error_boundary turns it into RetryRequested), a new job would resume the
    run under a run that says 'Canceling'. The step fails and Dagster ends the run Canceled."""
    try:
        yield
    except DagsterExecutionInterruptedError:
        raise Failure(
            description=f"{stage.name}: terminated from Dagster (run {context.run_id}): the training "
            f"job is stopped and not retried; materialize {stage.name} again to resume "
            "from its newest checkpoint",
            allow_retries=False,
        ) from None


def _materialize(
    context,
    stage: Stage,
    config: StageRunConfig,
    home: GhostvisHome,
    launcher: Launcher,
    overrides: dict[str, Any],
    variant: str | None,
) -> MaterializeResult:
    """Train the stage, or return the completed run of the same identity whose checks passed (a cache
    hit: same checkpoint, same MLflow run, metadata `cached_from`). The data version is the run key."""
    began = now_s()  # the launching side's timeline counts from here: planning and the lease come before a launch
    h = home.home()
    planned = _user_error(_prepare, context, stage, config, overrides, h, variant)
    expiry_s = planned.resolved.cfg.runtime.lease_expiry_s
    with run_lease(context, h.store, stage.name, planned.base_key, wait=config.wait, expiry_s=expiry_s) as lease:
        return _train_or_reuse(context, stage, config, h, launcher, planned, variant, Held(lease, began))


class Held(NamedTuple):
    """What the launching side holds while it trains a run: the identity's lease, and when the step began on this
    host's clock (the run's timeline counts its launches from there)."""

    lease: Lease
    began: float


def _train_or_reuse(
    context,
    stage: Stage,
    config: StageRunConfig,
    h: Home,
    launcher: Launcher,
    planned: PlannedRun,
    variant: str | None,
    held: Held,
) -> MaterializeResult:
    """Under the identity's lease: the cache is looked up only once no other launch is training it, so a second
    launch finds the first one's run instead of training it again into the same run key."""
    checks = [] if variant else stage_check_names()
    hit = (
        None
        if config.force
        else cached_stage_run(context.instance, h.store, context.asset_key.path[-1], planned, checks)
    )
    if hit:
        context.log.info(f"{stage.name}: cache hit, {hit.why}")
        spec = LaunchSpec.read(h.store, stage.name, hit.run_key)
    else:
        changed = changed_since(h.store, stage.name, planned)
        spec = _user_error(start_run, planned, h)
        run_job(context, launcher, spec, h, held)
    result = run_result(h.store, spec.stage, spec.run_key)
    md = {
        **result_metadata(result),
        **lineage_metadata(result, spec, h.store),
        **ledger_metadata(Ledger.in_store(h.store), spec.run_key),
    }
    if result.generated:  # rl: a run that sampled no rewarded completion learned nothing, and says why
        md |= reward_signal(context, h, spec)
    if hit:
        md["cached_from"] = MetadataValue.json({"run_key": hit.run_key, "why": hit.why})
    elif changed:
        md["changed_since"] = MetadataValue.json(changed)
    if variant:
        md["variant"] = variant
    else:
        md |= model_metadata(context, stage, spec, h, launcher, registered_by_job=hit is None)
    md |= goodput_metadata(context, h.store, result, spec.mlflow_tracking_uri, None if hit else held.began)
    return MaterializeResult(metadata=md, data_version=DataVersion(spec.run_key))


# A preempted job is launched again (it resumes from the checkpoint it committed when told to stop) without using
# up the stage's retry, which is kept for faults; this bounds a run that is preempted over and over.
MAX_PREEMPTIONS = 20
# Retries of a stage for faults; each resumes from the newest checkpoint.
FAULT_RETRIES = 3


def run_job(context, launcher: Launcher, spec: LaunchSpec, h: Home, held: Held) -> None:
    """Launch the job, again after each preemption, renewing the lease only while the job's ranks move their
    heartbeats, each launch and the step's wait for the lease recorded in the run's timeline; a problem of the
    run's inputs or settings that a rank named (a pre-flight refusal, a token block that does not match its digest,
    a checkpoint that fails verification) fails the step without a retry: the same inputs would stop it again."""
    record_lease_wait(h.store, spec.stage, spec.run_key, held.began, held.lease.waited)
    for launch in range(1, MAX_PREEMPTIONS + 2):
        try:
            job = training_job(spec)
            with (
                held.lease.renewed_while(frozen_watch(h, job)),
                recorded_launch(h.store, spec.stage, spec.run_key, held.began),
            ):
                launcher.run(context, job, h)
            return
        except Failure as failure:
            cancelled = getattr(failure.metadata.get(CANCELLED), "value", False)
            if was_preempted(h.store, spec.stage, spec.run_key) and not cancelled and launch <= MAX_PREEMPTIONS:
                reason = run_reason(h.store, spec.stage, spec.run_key)
                context.log.warning(
                    f"{spec.stage}: launch {launch} of run {spec.run_key} was {reason}; launching again"
                )
                continue
            lost = lost_lease(h.store, spec.stage, spec.run_key)
            if lost:  # another launch holds the run now: its records are the run's, and nothing here is retried
                raise Failure(description=f"{spec.stage} run {spec.run_key}: {lost}", allow_retries=False) from None
            if input_problem(h.store, spec.stage, spec.run_key) is None or not failure.allow_retries:
                raise
            raise Failure(
                description=f"{failure.description}\nnot retried: a problem of the run's inputs or settings, which "
                f"every retry would meet again; fix it as said, then materialize {spec.stage} again",
                allow_retries=False,
            ) from None


def reward_signal(context, h: Home, spec: LaunchSpec) -> dict:
    """rl: when none of the run's completions earned a reward, the warning that says so (the reward rule's form,
    an example completion, the fix) as metadata `reward_signal` and in the log; else nothing."""
    ledger = Ledger.in_store(h.store)
    note = unrewarded_note(h.store, ledger, StageRun.load(h.store, ledger, spec.stage, spec.run_key))
    if note is None:
        return {}
    context.log.warning(note)
    return {"reward_signal": note}


def register_by_job(context, launcher: Launcher, spec: LaunchSpec, h: Home) -> dict:
    """Register the run's model by a job of its own (`python -m ghostvis_core.run.hf.register`, launched where
    the training job ran), for a run whose job did not register it in this home's MLflow (a cache hit: its
    alias is pointed back at its version; MLflow was down; MLflow moved). A job that fails is said so in
    the record's place: the run stands."""
    try:
        launcher.run(context, registration_job(spec, h.mlflow_tracking_uri), h)
    except Failure as failed:
        return {"error": failed.description, "tracking_uri": h.mlflow_tracking_uri}
    return model_record(h.store, spec.stage, spec.run_key)


def model_metadata(
    context, stage: Stage, spec: LaunchSpec, h: Home, launcher: Launcher, registered_by_job: bool
) -> dict:
    """The run's model in MLflow's registry, as its training job registered it or, when that did not
    register it in this home's MLflow or a cache hit finds the stage's alias on another version, a
    registration job (register_by_job): the Dagster process never loads or registers a model (it reads
    where the alias points; a cache hit whose alias is already on the run's version launches nothing).
    If MLflow could not take it, the run stands: a warning and an `mlflow_model` entry say so, and the
    next materialization of the stage (a cache hit) registers it."""
    record = model_record(h.store, spec.stage, spec.run_key)
    registered = record is not None and "error" not in record
    if registered and registered_by_job:  # the training job registered it: in this home's MLflow?
        registered = record["tracking_uri"] == h.mlflow_tracking_uri
    elif registered:  # a cache hit: a job only when this home's registry lacks the alias on the run's version
        name = record["model_uri"].removeprefix("models:/").split("@")[0]
        run_id = run_result(h.store, spec.stage, spec.run_key).mlflow_run_id
        version = alias_on_run(h.mlflow_tracking_uri, name, spec.stage, run_id)
        registered = version is not None
        record = {**record, "version": version, "created": False}
    if not registered:
        record = register_by_job(context, launcher, spec, h)
    if "error" in record:
        why = (
            f"{stage.name}: the model of run {spec.run_key} is not registered in MLflow "
            f"({record['tracking_uri']}): {record['error']}; the run is complete: once MLflow is "
            f"reachable, materialize {stage.name} again (a cache hit) to register it"
        )
        context.log.warning(why)
        return {"mlflow_model": why}
    done = f"logged and registered in {record['seconds']:.1f} s" if record["created"] else "already registered"
    by = f"pid {record['pid']} on {record['host']}"
    context.log.info(f"{stage.name}: {record['model_uri']} -> version {record['version']} ({done} by {by})")
    name = record["model_uri"].removeprefix("models:/").split("@")[0]
    return {
        "mlflow_model": record["model_uri"],
        "mlflow_model_version": MetadataValue.int(record["version"]),
        "mlflow_model_url": MetadataValue.url(f"{mlflow_ui()}/#/models/{name}/versions/{record['version']}"),
        "mlflow_model_registered_by": by,
    }


def _user_error(fn, *args, **kwargs):
    """fn(...), a GhostvisError (bad input: retrying cannot help) becoming a non-retryable Failure."""
    try:
        return fn(*args, **kwargs)
    except GhostvisError as exc:
        raise Failure(description=str(exc), allow_retries=False) from None


def _prepare(
    context, stage: Stage, config: StageRunConfig, overrides: dict, h: Home, variant: str | None
) -> PlannedRun:
    """The run's identity, from the run config and the tokenizer and upstream materializations Dagster knows about."""
    preset = config.preset or selected.default_preset()
    overrides = {**presets.data_overrides(config.recipe, config.val_sources), **overrides}
    tokenizer_id = latest_metadata(context, "tokenizer")["tokenizer_id"]
    up, start = None, selected.lineage().upstream(stage.name)
    if start and "init_from" not in overrides:  # an init_from given in the run config is found by plan_run
        md = latest_metadata(context, start)
        up = Upstream(start, md["run_key"], md["checkpoint_uri"])
    return plan_run(
        stage.name, preset=preset, overrides=overrides, home=h, tokenizer_id=tokenizer_id, upstream=up, variant=variant
    )


# Every stage asset claims a slot of this Dagster concurrency pool while its job runs: set its limit to
# the number of stages the cluster's GPUs can hold at once (`dagster instance concurrency set gpu N`).
GPU_POOL = "gpu"


def variants_asset(stage: Stage, deps: list):
    """The stage once per named variant (presets.VARIANTS), as static partitions: backfill them all
    and compare the runs in MLflow (same metric names, params differing by the variant)."""
    variants = presets.VARIANTS[stage.name]

    @asset(
        name=f"{stage.name}_variants",
        group_name="training",
        kinds={"torch", "mlflow"},
        owners=["team:training"],
        deps=deps,
        partitions_def=StaticPartitionsDefinition(list(variants)),
        pool=GPU_POOL,
        code_version=code_version(*TRAINING_MODULES),
        description=f"{stage.description} One partition per variant: "
        + "; ".join(f"{k}: {v}" for k, v in variants.items()),
    )
    def _variants(
        context: AssetExecutionContext, config: StageRunConfig, home: GhostvisHome, launcher: Launcher
    ) -> MaterializeResult:
        name = context.partition_key
        with _terminated_not_retried(context, stage):
            return _materialize(context, stage, config, home, launcher, {**variants[name], **config.overrides}, name)

    return _variants


def stage_asset(stage: Stage, deps: list):
    """The stage's asset. Every stage below it is a dependency, not only its upstream: a stage's run is
    made of the whole chain (its identity holds its upstream's run key, which holds that one's), while
    Dagster marks an asset unsynced only when a direct dependency's data version changed (its
    CachingStaleStatusResolver does not carry a parent's stale causes down). So a re-trained pretrain
    leaves every stage above it unsynced, each naming pretrain, in the UI and in `ghostvis status`."""
    chain = selected.lineage()

    @asset(
        name=stage.name,
        group_name="training",
        kinds={"torch", "mlflow"},
        owners=["team:training"],
        deps=[*deps, *(name for name in chain.below(stage.name) if name not in deps)],
        description=f"{stage.description} Lineage {chain.name}: starts from {chain.start_text(stage.name)}.",
        pool=GPU_POOL,
        code_version=code_version(*TRAINING_MODULES),
        # A retry re-materializes through the same path: the unfinished run is found and resumed. For
        # faults only (a killed rank, a lost node, a hang): a terminated run is not retried
        # (_terminated_not_retried), a preempted one is launched again by run_job without using a retry.
        retry_policy=RetryPolicy(max_retries=FAULT_RETRIES, delay=2, backoff=Backoff.LINEAR),
    )
    def _stage(
        context: AssetExecutionContext, config: StageRunConfig, home: GhostvisHome, launcher: Launcher
    ) -> MaterializeResult:
        with _terminated_not_retried(context, stage):
            return _materialize(context, stage, config, home, launcher, dict(config.overrides), None)

    return _stage

"""Training stage assets: each materialization prepares a run, launches torchrun through Pipes,
and records the token figures, MLflow run and checkpoint as metadata."""


import os
from typing import Any

from dagster import (
    AssetExecutionContext, Backoff, Config, Failure, MaterializeResult, MetadataValue, RetryPolicy,
    StaticPartitionsDefinition, asset,
)

from ghostvis_core import presets
from ghostvis_core.data.ledger import Ledger
from ghostvis_core.errors import GhostvisError
from ghostvis_core.home import Home
from ghostvis_core.train.launch import Upstream, prepare_run
from ghostvis_core.train.spec import LaunchSpec
from ghostvis_pipeline.metadata import latest_metadata, md_table
from ghostvis_pipeline.resources import GhostvisHome, TorchrunLauncher

STAGE_DESCRIPTIONS = {
    "pretrain": "Pretrains the decoder LM from scratch on the token ledger's train shards (torchrun, DDP).",
    "continued_pretrain": "Continues pretraining on a declared domain mixture (code-heavy), where pretraining "
                          "stopped reading each source. Evidence: mixture fractions vs recipe, domain loss.",
    "context_expansion": "Raises the context (256 -> 1024) with RoPE position interpolation on long documents. "
                         "Evidence: held-out loss beyond the old context, before vs after.",
    "reasoning_mix": "Trains on step-by-step arithmetic problems plus declared replay of earlier prose. "
                     "Evidence: answer-token loss and answer accuracy, before vs after.",
    "vision_alignment": "Trains a perceiver resampler + MLP projector between a frozen vision encoder and the "
                        "frozen LM on image-caption pairs. Evidence: caption loss, true vs shuffled image.",
    "sft": "Supervised fine-tuning on packed chats, loss on assistant tokens only. Evidence: assistant loss "
           "and how many sampled replies end with <|eot|>.",
    "dpo": "Direct preference optimisation against the frozen SFT model. Evidence: preference accuracy "
           "and reward margin on held-out pairs.",
}

INT_FIELDS = ("planned_tokens", "real_tokens", "pad_tokens", "loss_tokens", "cropped_tokens", "tokens_per_step",
              "micro_batch_size", "seq_len", "world_size", "grad_accum_steps", "steps", "segment")
FLOAT_FIELDS = ("val_loss", "val_loss_start", "train_loss", "tokens_per_sec", "first_step_s", "wall_time_s")
EVIDENCE_SUFFIXES = ("_before", "_after")


class StageRunConfig(Config):
    """Preset name plus dotted overrides of the stage config, e.g. {"budget.steps": "50"}."""

    preset: str = presets.default_preset()
    overrides: dict[str, str] = {}


def mlflow_url(experiment_id: Any, run_id: str) -> str:
    base = os.environ.get("GHOSTVIS_MLFLOW_UI", "http://127.0.0.1:5000").rstrip("/")
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}"


def stage_metadata(result: dict[str, Any], spec: LaunchSpec, home: Home) -> dict[str, Any]:
    md: dict[str, Any] = {k: MetadataValue.int(int(result[k])) for k in INT_FIELDS if k in result}
    md.update({k: MetadataValue.float(float(result[k])) for k in FLOAT_FIELDS if result.get(k) is not None})
    for k, v in result.items():  # evidence figures, mixture fractions, frozen-parameter hashes
        if k.endswith(EVIDENCE_SUFFIXES) or k.startswith("mixture/") or k.startswith("frozen_params"):
            md[k] = MetadataValue.float(float(v)) if isinstance(v, (int, float)) else str(v)
    md["run_key"] = spec.run_key
    md["mlflow_run_id"] = result["mlflow_run_id"]
    md["mlflow_url"] = MetadataValue.url(mlflow_url(result["mlflow_experiment_id"], result["mlflow_run_id"]))
    md["checkpoint_uri"] = MetadataValue.path(result["checkpoint_uri"])
    md["tokenizer_id"] = spec.tokenizer_id
    if spec.parent_run_key:
        md["parent_run_key"] = spec.parent_run_key
        md["init_checkpoint"] = MetadataValue.path(spec.init_checkpoint or "")
    budget = spec.extra.get("source_budget", {})
    md["source_budget"] = MetadataValue.md(md_table(
        ["source", "needed_tokens", "available_tokens", "shards", "epochs"],
        [[s, b["needed_tokens"], b["available_tokens"], b["shards"], b["epochs"]] for s, b in budget.items()]))
    ledger = Ledger(home.ledger)
    segs: dict[int, dict[str, int]] = {}
    for part in ledger.chain(spec.run_key):
        seg = segs.setdefault(part["segment"], {"segment": part["segment"], "first_step": part["step_first"],
                                                "world_size": part["world_size"], "real_tokens": 0})
        seg["last_step"] = part["step_last"]
        seg["real_tokens"] += part["real_tokens"]
    md["segments"] = MetadataValue.md(md_table(
        ["segment", "steps", "world_size", "real_tokens"],
        [[g["segment"], f"{g['first_step']}..{g['last_step']}", g["world_size"], g["real_tokens"]] for g in segs.values()]))
    md["segment_count"] = len(segs)
    consumed = ledger.consumed_by_shard(spec.run_key)
    md["shards_consumed"] = MetadataValue.md(md_table(
        ["shard", "split", "tokens", "rows", "epochs"],
        [[r["shard_id"], r["split"], r["tokens"], f"{r['row_start']}..{r['row_end']}", r["epochs"]] for r in consumed]))
    return md


def _launch(context, stage: str, upstream: str | None, config: StageRunConfig, home: GhostvisHome,
            launcher: TorchrunLauncher, overrides: dict[str, str], variant: str | None = None) -> MaterializeResult:
    h = home.home()
    try:
        tokenizer_id = latest_metadata(context, "tokenizer")["tokenizer_id"]
        up = None
        if upstream:
            md = latest_metadata(context, upstream)
            up = Upstream(upstream, md["run_key"], md["checkpoint_uri"])
        spec = prepare_run(stage, preset=config.preset, overrides=overrides, home=h,
                           tokenizer_id=tokenizer_id, upstream=up, variant=variant)
    except GhostvisError as exc:  # bad input: retrying cannot help
        raise Failure(description=str(exc), allow_retries=False) from None
    result = launcher.run(context, spec, h)
    md = stage_metadata(result, spec, h)
    if variant:
        md["variant"] = variant
    return MaterializeResult(metadata=md)


def variants_asset(stage: str, upstream: str | None, deps: list):
    """The stage once per named variant (presets.VARIANTS), as static partitions: backfill them all
    and compare the runs in MLflow (same metric names, params differing by the variant)."""
    variants = presets.VARIANTS[stage]

    @asset(
        name=f"{stage}_variants",
        group_name="training",
        kinds={"torch", "mlflow"},
        owners=["team:training"],
        deps=deps,
        partitions_def=StaticPartitionsDefinition(list(variants)),
        description=f"{STAGE_DESCRIPTIONS[stage]} One partition per variant: "
                    + "; ".join(f"{k}: {v}" for k, v in variants.items()),
    )
    def _variants(context: AssetExecutionContext, config: StageRunConfig, home: GhostvisHome,
                  launcher: TorchrunLauncher) -> MaterializeResult:
        name = context.partition_key
        return _launch(context, stage, upstream, config, home, launcher,
                       {**variants[name], **config.overrides}, variant=name)

    return _variants


def stage_asset(stage: str, upstream: str | None, deps: list):
    @asset(
        name=stage,
        group_name="training",
        kinds={"torch", "mlflow"},
        owners=["team:training"],
        deps=deps,
        description=STAGE_DESCRIPTIONS[stage],
        # A retry re-materializes through the same path: the unfinished run is found and resumed.
        retry_policy=RetryPolicy(max_retries=1, delay=2, backoff=Backoff.LINEAR),
    )
    def _stage(context: AssetExecutionContext, config: StageRunConfig, home: GhostvisHome,
               launcher: TorchrunLauncher) -> MaterializeResult:
        return _launch(context, stage, upstream, config, home, launcher, dict(config.overrides))

    return _stage

"""Prepare a stage run before any process starts: config, data selection, pre-flight, run key.

Everything that can be wrong with the inputs is found here, before torchrun: an unknown preset, a
batch that does not divide, a missing tokenized shard. The pre-flight's functions are here too; the job
runs them (a budget larger than the data, streams that mix splits, a GPU too small).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from ghostvis_core import identity
from ghostvis_core.data.bpe_tokenizer import Tokenizer, load_tokenizer, newest_tokenizer
from ghostvis_core.data.catalog import load_manifest, recorded_sha256
from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.ledger.records import ShardRecord
from ghostvis_core.data.ledger.summaries import validation_selected
from ghostvis_core.data.problems import DEFAULT_RULE
from ghostvis_core.data.shard_ref import ShardRef
from ghostvis_core.errors import GhostvisError
from ghostvis_core.home import Home
from ghostvis_core.plan import presets, selected, stages
from ghostvis_core.plan.budget import Plan
from ghostvis_core.plan.budget import plan as make_plan
from ghostvis_core.plan.config import StageConfig
from ghostvis_core.plan.presets import RegisteredSources, TokenizerVocab
from ghostvis_core.run.hf.checkpoint_sources import is_hf_source
from ghostvis_core.runs.launch_spec import LaunchSpec, Shards, StageInputs
from ghostvis_core.runs.lookup import Upstream, checkpoint_key, checkpoint_of, find_upstream, next_run_key
from ghostvis_core.store import Store

MLFLOW_EXPERIMENT = "ghostvis"


def select_shards(ledger: Ledger, store: Store, tokenizer_id: str, sources: list[str], split: str) -> Shards:
    """Ledger shards of the given sources and split; every token file must be in the store, and be of the
    shard's current content: a shard whose file changed under its name trains only once its new version
    is tokenized (the old version's tokens stay for the runs that read them)."""
    out: dict[str, list[ShardRef]] = {s: [] for s in sources}
    for r in ledger.shards(tokenizer_id=tokenizer_id, sources=sources):
        if r.split != split:
            continue
        current = recorded_sha256(store, r.shard_id)
        if current is not None and current != r.content_sha256:
            raise GhostvisError(
                f"shard {r.shard_id} changed under its name: raw_shards recorded content sha256 {current}, "
                f"but the ledger's newest tokenization with {tokenizer_id} is of sha256 {r.content_sha256}; "
                f"re-materialize tokenized_shards partition {r.shard_id} to tokenize the new version"
            )
        key = (tokenizer_id, r.shard_id, r.content_sha256)
        if not store.exists("token_shard", *key):
            raise GhostvisError(
                f"tokenized shard {r.shard_id} ({store.uri_of('token_shard', *key)}) is in "
                f"the ledger but missing on disk; re-materialize tokenized_shards partition {r.shard_id}"
            )
        path = store.uri_of("token_shard", *key)  # a stream fetches it when it opens the shard (objectives.py)
        out[r.source].append(ShardRef(r.shard_id, r.source, r.split, path, r.docs, r.tokens, r.content_sha256))
    empty = [s for s, refs in out.items() if not refs]
    if empty:
        raise GhostvisError(
            f"no {split} shards tokenized with {tokenizer_id} for source(s) {', '.join(empty)}; "
            f"materialize raw_shards and tokenized_shards for them first"
        )
    selected = {s: tuple(refs) for s, refs in out.items()}
    leaked = validation_selected(ledger, tokenizer_id, selected) if split == "train" else []
    if leaked:
        names = ", ".join(f"{r.shard_id} ({r.split})" for r in leaked)
        raise GhostvisError(
            f"shard(s) {names} selected for training are not train shards in the ledger; "
            "training must never read them: fix the shard selection (select_shards filters by "
            "split) or the shard's split pin in its manifest, then re-launch"
        )
    return selected


def lineage_offsets(ledger: Ledger, parent_run_key: str, train_shards: Shards, sources: list[str]) -> dict[str, int]:
    """Where the lineage stopped reading each source's token stream, so this stage continues
    there instead of re-reading it (stream coordinates: epoch x total + shard start + token)."""
    offsets: dict[str, int] = {}
    for src in sources:
        refs = sorted(train_shards[src], key=lambda r: r.shard_id)
        starts, pos = {}, 0
        for r in refs:
            starts[r.shard_id] = pos
            pos += r.tokens
        end = 0
        for run in ledger.lineage(parent_run_key):
            for c in ledger.consumption(ledger.chain(run)):
                if c.source == src and c.shard_id in starts:
                    end = max(end, c.epoch * pos + starts[c.shard_id] + c.tok_end)
        offsets[src] = end
    return offsets


@dataclass
class Resolved:
    """A stage's config as it will train: preset + overrides + upstream model + tokenizer."""

    cfg: StageConfig
    upstream: Upstream | None
    upstream_cfg: dict[str, Any] | None
    tok: Tokenizer


def resolve_stage(
    stage: str, preset: str, overrides: dict[str, Any], home: Home, tokenizer_id: str | None, upstream: Upstream | None
) -> Resolved:
    """Gather what resolution needs (the upstream checkpoint's config, the tokenizer, the registered sources) and
    resolve the stage's config once, with all of them as inputs."""
    init_from = presets.init_source(stage, overrides)
    chain = selected.lineage()
    if init_from is None and chain.needs_model(stage):
        raise GhostvisError(
            f"stage {stage} starts the lineage {chain.name} ({chain.describe()}) on top of a model you give: set "
            "init_from to a Hugging Face checkpoint (--set init_from=./my-model, s3://bucket/prefix or "
            "hf://org/name@revision), or add the stage it starts from to GHOSTVIS_LINEAGE"
        )
    imported = None
    if init_from and is_hf_source(init_from):  # over the upstream stage a caller passes
        from ghostvis_core.run.hf.imports import import_checkpoint  # torch: only for a Hugging Face checkpoint

        asked = tokenizer_id or (newest_tokenizer(home.store) if home.store.keys("tokenizer") else None)
        imported = import_checkpoint(home.store, init_from)
        upstream, tokenizer_id = imported.upstream, model_tokenizer(home.store, asked, imported.tokenizer)
    elif init_from and upstream is None:
        if init_from not in stages.stage_names():
            raise GhostvisError(
                f"stage {stage}: init_from '{init_from}' is neither a stage ({', '.join(stages.stage_names())}) "
                "nor a Hugging Face checkpoint (a folder path, s3://bucket/prefix or hf://org/name[@revision])"
            )
        upstream = find_upstream(home.store, init_from)
    up_cfg = None
    if upstream:
        if not home.store.exists("checkpoint", *checkpoint_key(upstream.checkpoint)):
            raise GhostvisError(
                f"stage {stage}: upstream checkpoint {upstream.checkpoint} is missing; "
                f"materialize the `{upstream.stage}` asset first"
            )
        up_cfg = json.loads((checkpoint_of(home.store, upstream.checkpoint) / "config.json").read_text())
    tokenizer_id = tokenizer_id or newest_tokenizer(home.store)
    tok = load_tokenizer(tokenizer_id, home.store)
    shards = tuple(Ledger.in_store(home.store).shards(tokenizer_id=tokenizer_id))
    if imported:  # before the sources are looked up with its tokenizer: the fix is to tokenize with it
        check_imported_data(stage, init_from, tok, shards)
    cfg = presets.resolve(
        stage,
        preset,
        overrides,
        upstream=up_cfg,
        sources=RegisteredSources(tokenizer_id, shards),
        vocab=None if imported else TokenizerVocab(tok.tokenizer_id, tok.vocab_size),
    )
    return Resolved(cfg, upstream, up_cfg, tok)


def model_tokenizer(store: Store, asked: str | None, model_tok: Tokenizer) -> str:
    """An imported model's tokenizer; the `tokenizer` asset's (`asked`) when it is that model's with the chat
    markers mapped its own way (its special_tokens): the same ids, so the model reads its data as it was trained."""
    if asked and asked != model_tok.tokenizer_id and load_tokenizer(asked, store).same_ids(model_tok):
        return asked
    return model_tok.tokenizer_id


def check_imported_data(stage: str, init_from: str, tok: Tokenizer, shards: tuple[ShardRecord, ...]) -> None:
    """An imported model trains on shards tokenized with its own tokenizer (its vocab_size, from its
    config.json, already covers the tokenizer's ids: tokenizer_file.read_tokenizer_file checked it)."""
    if not shards:
        raise GhostvisError(
            f"stage {stage}: init_from {init_from} brings tokenizer {tok.tokenizer_id} (saved in the store), but "
            f"no shard is tokenized with it; materialize tokenizer with from_model: {init_from}, then "
            "tokenized_shards, before training from this checkpoint"
        )


def reward_rules(store: Store, cfg: StageConfig) -> dict[str, str]:
    """grpo: each source's reward rule, from its manifest (a source the stage reads must be of problems)."""
    rules = {}
    for source in sorted({s.source for s in cfg.data.recipe} | set(cfg.data.val_sources)):
        m = load_manifest(store, source)
        if m.kind != "problem":
            raise GhostvisError(
                f"stage {cfg.stage}: source {source} is a {m.kind} source; grpo reads problems (prompt + answer): "
                "declare one in shard_manifest (kind: problem, reward: integer, string or regex:<pattern>) and "
                "set the stage's recipe to it"
            )
        rules[source] = m.reward or DEFAULT_RULE
    return rules


def stage_inputs(r: Resolved, store: Store, ledger: Ledger, train_shards: Shards) -> StageInputs:
    """What the stage takes from its lineage: where to continue each source, the old context, ..."""
    cfg, up_model = r.cfg, (r.upstream_cfg or {}).get("model")
    longer = bool(up_model and up_model["max_seq_len"] < cfg.model.max_seq_len)
    fresh = [s.source for s in cfg.data.recipe if s.source not in cfg.data.replay_sources]
    return StageInputs(
        stream_offsets=(
            lineage_offsets(ledger, r.upstream.run_key, train_shards, fresh)
            if r.upstream and cfg.objective == "lm"
            else {}
        ),
        old_seq_len=up_model["max_seq_len"] if longer else None,
        upstream_rope_base=up_model["rope_base"] if longer else None,
        upstream_rope_scaling=up_model["rope_scaling"] if longer else None,
        reasoning_source=(
            max(cfg.data.recipe, key=lambda s: s.weight).source if "reasoning" in cfg.eval.evidence else None
        ),
        reward_rules=reward_rules(store, cfg) if cfg.objective == "grpo" else {},
        new_vision=cfg.vision is not None and not (r.upstream_cfg or {}).get("vision"),
    )


def run_identity(r: Resolved, p: Plan, train: Shards, validation: Shards, inputs: StageInputs) -> dict[str, Any]:
    """What the run trains, never where: the config minus how it is split over ranks (a resume on another
    world size with the same tokens_per_step finds the same run), the tokenizer, the content hashes of
    the shards it reads (train and validation, from the ledger), the upstream run's key (its data
    version) and what the lineage hands over. No path, store URI, host, time or launcher."""
    ident_cfg = r.cfg.to_dict()
    for k in ("world_size", "micro_batch_size", "grad_accum_steps", "total_batch_tokens"):
        ident_cfg["batch"].pop(k)
    ident_cfg["batch"]["tokens_per_step"] = p.batch.tokens_per_step
    for how in ("async_save", "every_minutes"):  # how and when shards are written, not what is trained
        ident_cfg["checkpoint"].pop(how)
    for how in ("hang_timeout_s", "lease_expiry_s", "preempt_grace_s"):  # how a run is watched and stopped
        ident_cfg["runtime"].pop(how)
    ident_cfg.pop("contamination")  # what the run is checked against, not what it trains

    def contents(shards: Shards) -> dict[str, list[str]]:
        return {s: [x.content_sha256 for x in refs] for s, refs in shards.items()}

    return {
        "config": ident_cfg,
        "tokenizer": r.tok.tokenizer_id,
        "train": contents(train),
        "validation": contents(validation),
        "upstream": r.upstream.run_key if r.upstream else None,
        "inputs": asdict(inputs),
    }


# The modules that make a stage's checkpoint: the torchrun entry point and the launch preparation (and,
# through identity.code_version, every ghostvis_core module they import). The Dagster code_version.
TRAINING_MODULES = ("ghostvis_core.run.__main__", "ghostvis_core.launch.start")


@dataclass(frozen=True)
class PlannedRun:
    """A stage run resolved and identified, before its attempt: what a cache looks up. Its LaunchSpec is
    built whole once the attempt's run key is known (`start_run`)."""

    stage: str
    base_key: str  # <stage>-<identity digest> (<stage>@<variant>-... for a variant): its attempts are base-r<n>
    identity: dict[str, Any]  # what the digest hashes, saved beside each attempt (artifact kind "identity")
    resolved: Resolved
    plan: Plan
    train_shards: Shards
    val_shards: Shards
    inputs: StageInputs
    preset: str
    variant: str | None = field(default=None)


def plan_run(
    stage: str,
    *,
    preset: str = selected.DEFAULT_PRESET,
    overrides: dict[str, Any] | None = None,
    home: Home | None = None,
    tokenizer_id: str | None = None,
    upstream: Upstream | None = None,
    variant: str | None = None,
) -> PlannedRun:
    """Resolve a stage run and derive its identity; reads the ledger and the manifests, no shard file."""
    home = home or Home.from_env()
    r = resolve_stage(stage, preset, overrides or {}, home, tokenizer_id, upstream)
    ledger = Ledger.in_store(home.store)
    recipe_sources = [s.source for s in r.cfg.data.recipe]
    train = select_shards(ledger, home.store, r.tok.tokenizer_id, recipe_sources, "train")
    validation = (
        select_shards(ledger, home.store, r.tok.tokenizer_id, r.cfg.data.val_sources, "validation")
        if r.cfg.data.val_sources
        else {}
    )
    p = make_plan(r.cfg)
    inputs = stage_inputs(r, home.store, ledger, train)
    ident = run_identity(r, p, train, validation, inputs)
    name = f"{stage}@{variant}" if variant else stage
    base_key = f"{name}-{identity.digest(ident, 10)}"
    return PlannedRun(stage, base_key, ident, r, p, train, validation, inputs, preset, variant)


def launch_spec(planned: PlannedRun, run_key: str, home: Home) -> LaunchSpec:
    """The attempt's LaunchSpec, whole: the one place one is built."""
    r = planned.resolved
    return LaunchSpec(
        stage=planned.stage,
        run_key=run_key,
        config=r.cfg,
        plan=planned.plan,
        store=home.store.uri,
        tokenizer_id=r.tok.tokenizer_id,
        train_shards=planned.train_shards,
        val_shards=planned.val_shards,
        mlflow_tracking_uri=home.mlflow_tracking_uri,
        mlflow_experiment=MLFLOW_EXPERIMENT,
        mlflow_artifact_location=home.mlflow_artifacts.as_uri(),
        parent_run_key=r.upstream.run_key if r.upstream else None,
        init_checkpoint=r.upstream.checkpoint if r.upstream else None,
        tags=run_tags(planned.stage, run_key, r.tok.tokenizer_id, planned.preset, r.upstream, planned.variant),
        inputs=planned.inputs,
    )


def start_run(planned: PlannedRun, home: Home) -> LaunchSpec:
    """The attempt (the newest unfinished one is resumed, else a new one starts) and its launch record, saved
    without overwriting one (`LaunchSpec.save`: a resume launched as saved writes nothing, one launched otherwise,
    e.g. on another world size, a record of its own), beside the run's identity and the code version that made
    it (saved at its first launch; a resume must train the same). The job's pre-flight keeps what it finds in a
    record of its own (runs/preflight_findings.py); it runs in the job, on rank 0 (ghostvis_core/run/preflight.py)."""
    spec = launch_spec(planned, next_run_key(home.store, planned.stage, planned.base_key), home)
    save_identity(home.store, planned, spec.run_key)
    spec.save(home.store)
    return spec


def save_identity(store: Store, planned: PlannedRun, run_key: str) -> None:
    """The run's identity record, created at its first launch; a resume's identity must equal it (the run key
    hashes it, so only an edited record or a digest collision differs)."""
    record = {"identity": planned.identity, "code_version": identity.code_version(*TRAINING_MODULES)}
    if store.create_json("identity", planned.stage, run_key, data=record):
        return
    saved = store.read_json("identity", planned.stage, run_key)["identity"]
    changed = identity.changed_inputs(saved, json.loads(json.dumps(planned.identity, default=str)))
    if changed:
        raise GhostvisError(
            f"run {run_key}: this launch trains another {', '.join(changed)} than the run's identity record "
            f"{store.uri_of('identity', planned.stage, run_key)} says it was started with; the record was changed "
            f"since: delete the run's folders (runs/, checkpoints/ and that record) to train it again"
        )


def prepare_run(stage: str, *, home: Home | None = None, **planning: Any) -> LaunchSpec:
    """Resolve a stage run and save its spec: plan_run then start_run, `planning` being plan_run's keywords
    (preset, overrides, tokenizer_id, upstream, variant). A `variant` (a named set of overrides) gets run
    keys of its own, <stage>@<variant>-..., so it never becomes another stage's upstream by accident."""
    home = home or Home.from_env()
    return start_run(plan_run(stage, home=home, **planning), home)


def run_tags(
    stage: str, run_key: str, tokenizer_id: str, preset: str, upstream: Upstream | None, variant: str | None
) -> dict[str, str]:
    """MLflow tags: the run's stage, key, preset, tokenizer and lineage."""
    tags = {
        "ghostvis.stage": stage,
        "ghostvis.run_key": run_key,
        "ghostvis.preset": preset,
        "ghostvis.tokenizer_id": tokenizer_id,
    }
    if upstream:
        tags |= {
            "ghostvis.parent_run_key": upstream.run_key,
            "ghostvis.init_checkpoint": upstream.checkpoint,
            "ghostvis.upstream_stage": upstream.stage,
        }
    if variant:
        tags["ghostvis.variant"] = variant
    return tags

"""Prepare a stage run before any process starts: config, data selection, pre-flight, run key.

Everything that can be wrong with the inputs is found here, before torchrun: an unknown preset, a
batch that does not divide, a missing tokenized shard, a budget larger than the data.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ghostvis_core import presets
from ghostvis_core.budget import batch_plan, plan as make_plan
from ghostvis_core.config import StageConfig
from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.stream import ShardRef
from ghostvis_core.data.tokenizer import load_tokenizer
from ghostvis_core.errors import GhostvisError
from ghostvis_core.home import Home
from ghostvis_core.train.loop import RUN_COMPLETE
from ghostvis_core.train.spec import LaunchSpec

MLFLOW_EXPERIMENT = "ghostvis"


@dataclass(frozen=True)
class Upstream:
    """The checkpoint a stage starts from, and the run that wrote it."""

    stage: str
    run_key: str
    checkpoint: str


def newest_tokenizer(home: Home) -> str:
    root = home.store / "tokenizers"
    found = sorted(root.glob("*/tokenizer.json"), key=lambda p: p.stat().st_mtime) if root.exists() else []
    if not found:
        raise GhostvisError(f"no tokenizer in {root}; materialize the `tokenizer` asset first (or run `ghostvis demo`)")
    return found[-1].parent.name


def completed_runs(home: Home, stage: str) -> list[dict[str, Any]]:
    """RUN_COMPLETE records of a stage (not of its variants), oldest first."""
    root = home.store / "checkpoints" / stage
    if not root.exists():
        return []
    recs = [json.loads(p.read_text()) for p in root.glob(f"*/{RUN_COMPLETE}") if "@" not in p.parent.name]
    return sorted(recs, key=lambda r: Path(r["checkpoint_uri"]).parent.joinpath(RUN_COMPLETE).stat().st_mtime)


def find_upstream(home: Home, stage: str) -> Upstream:
    runs = completed_runs(home, stage)
    if not runs:
        raise GhostvisError(f"upstream stage '{stage}' has no completed run; materialize the `{stage}` asset first")
    last = runs[-1]
    return Upstream(stage, last["run_key"], last["checkpoint_uri"])


def select_shards(ledger: Ledger, tokenizer_id: str, sources: list[str], split: str) -> dict[str, list[dict]]:
    """Ledger shards of the given sources and split; every file must be on disk."""
    rows = ledger.shards(tokenizer_id=tokenizer_id, sources=sources)
    out: dict[str, list[dict]] = {s: [] for s in sources}
    for r in rows:
        if r["split"] != split:
            continue
        if not Path(r["token_path"]).exists():
            raise GhostvisError(
                f"tokenized shard {r['shard_id']} ({r['token_path']}) is in the ledger but missing on disk; "
                f"re-materialize tokenized_shards partition {r['shard_id']}"
            )
        out[r["source"]].append(
            ShardRef(r["shard_id"], r["source"], r["split"], r["token_path"], r["docs"], r["tokens"],
                     r["content_sha256"]).__dict__
        )
    empty = [s for s, refs in out.items() if not refs]
    if empty:
        raise GhostvisError(
            f"no {split} shards tokenized with {tokenizer_id} for source(s) {', '.join(empty)}; "
            f"materialize raw_shards and tokenized_shards for them first"
        )
    return out


def preflight(cfg: StageConfig, plan_steps: int, objective) -> dict[str, dict[str, Any]]:
    """Per source: tokens the budget needs vs tokens available. Refuses to start on a shortfall."""
    bp = batch_plan(cfg.batch)
    rows = objective.batcher.rows_per_source(plan_steps * bp.rows_per_step)
    report, problems = {}, []
    for rs in objective.batcher.sources:
        needed = rs.tokens_for_rows(rows[rs.source])
        available = rs.available_tokens
        shards = len(objective.train_streams[rs.source].refs)
        epochs = needed / max(1, available)
        report[rs.source] = {"needed_tokens": needed, "available_tokens": available, "shards": shards,
                             "epochs": round(epochs, 3)}
        if needed > available and not cfg.data.allow_repeat:
            per_shard = available / shards
            more = math.ceil((needed - available) / max(1.0, per_shard))
            problems.append(
                f"source {rs.source}: the budget needs {needed:,} tokens but {available:,} are available in "
                f"{shards} tokenized shards ({epochs:.2f} epochs); tokenize about {more} more shards "
                f"(~{per_shard:,.0f} tokens each) or lower the budget, or set data.allow_repeat=true to repeat "
                f"the data {epochs:.2f} times"
            )
    if problems:
        raise GhostvisError("pre-flight failed: " + "; ".join(problems))
    return report


def lineage_offsets(ledger: Ledger, parent_run_key: str, train_shards: dict[str, list[dict]],
                    sources: list[str]) -> dict[str, int]:
    """Where the lineage stopped reading each source's token stream, so this stage continues
    there instead of re-reading it (stream coordinates: epoch x total + shard start + token)."""
    offsets: dict[str, int] = {}
    for src in sources:
        refs = sorted(train_shards[src], key=lambda r: r["shard_id"])
        starts, pos = {}, 0
        for r in refs:
            starts[r["shard_id"]] = pos
            pos += r["tokens"]
        end = 0
        for run in ledger.lineage(parent_run_key):
            ids = [p["part_id"] for p in ledger.chain(run)]
            for c in ledger.consumption(ids):
                if c["source"] == src and c["shard_id"] in starts:
                    end = max(end, c["epoch"] * pos + starts[c["shard_id"]] + c["tok_end"])
        offsets[src] = end
    return offsets


def prepare_run(
    stage: str,
    *,
    preset: str = "tiny",
    overrides: dict[str, Any] | None = None,
    home: Home | None = None,
    tokenizer_id: str | None = None,
    upstream: Upstream | None = None,
    variant: str | None = None,
) -> LaunchSpec:
    """Resolve a stage run. A `variant` (a named set of overrides) gets run keys of its own,
    <stage>@<variant>-..., so it never becomes another stage's upstream by accident."""
    home = home or Home.from_env()
    defaults_from = presets.resolve(stage, preset, overrides)
    if defaults_from.init_from and upstream is None:
        upstream = find_upstream(home, defaults_from.init_from)
    up_cfg = None
    if upstream:
        cfg_file = Path(upstream.checkpoint) / "config.json"
        if not cfg_file.exists():
            raise GhostvisError(
                f"stage {stage}: upstream checkpoint {upstream.checkpoint} is missing; "
                f"materialize the `{upstream.stage}` asset first"
            )
        up_cfg = json.loads(cfg_file.read_text())
    cfg = presets.resolve(stage, preset, overrides, upstream=up_cfg)
    tokenizer_id = tokenizer_id or newest_tokenizer(home)
    tok = load_tokenizer(tokenizer_id, home.store / "tokenizers")
    vocab = 64 * math.ceil(tok.vocab_size / 64)
    if up_cfg is None:
        if "model.vocab_size" in (overrides or {}) and cfg.model.vocab_size != vocab:
            raise GhostvisError(f"model.vocab_size={cfg.model.vocab_size} does not fit tokenizer {tokenizer_id} "
                                f"({tok.vocab_size} tokens, padded to {vocab}); drop the override")
        cfg.model.vocab_size = vocab
    elif cfg.model.vocab_size != vocab:
        raise GhostvisError(
            f"stage {stage}: tokenizer {tokenizer_id} has {tok.vocab_size} tokens (padded {vocab}) but the upstream "
            f"{upstream.stage} model has vocab_size {cfg.model.vocab_size}; the tokenizer changed since that run — "
            f"re-run the chain from pretrain with this tokenizer"
        )

    ledger = Ledger(home.ledger)
    train_shards = select_shards(ledger, tok.tokenizer_id, [s.source for s in cfg.data.recipe], "train")
    val_shards = select_shards(ledger, tok.tokenizer_id, cfg.data.val_sources, "validation") if cfg.data.val_sources else {}
    p = make_plan(cfg)
    extra: dict[str, Any] = {}
    if upstream and cfg.objective == "lm":
        fresh = [s.source for s in cfg.data.recipe if s.source not in cfg.data.replay_sources]
        extra["stream_offsets"] = lineage_offsets(ledger, upstream.run_key, train_shards, fresh)
    if up_cfg and up_cfg["model"]["max_seq_len"] < cfg.model.max_seq_len:
        extra["old_seq_len"] = up_cfg["model"]["max_seq_len"]
        extra["upstream_rope"] = {k: up_cfg["model"][k] for k in ("rope_base", "rope_scaling")}
    if "reasoning" in cfg.eval.evidence:
        extra["reasoning_source"] = max(cfg.data.recipe, key=lambda s: s.weight).source
    if cfg.vision is not None and not (up_cfg or {}).get("vision"):
        extra["new_vision"] = True

    spec = LaunchSpec(
        stage=stage, run_key="", config=cfg.to_dict(), plan=p.to_dict(), home=str(home.root),
        tokenizer_id=tok.tokenizer_id, tokenizer_dir=str(home.tokenizer_dir(tok.tokenizer_id)),
        train_shards=train_shards, val_shards=val_shards, checkpoint_dir="", ledger_dir=str(home.ledger),
        mlflow_tracking_uri=home.mlflow_tracking_uri, mlflow_experiment=MLFLOW_EXPERIMENT,
        mlflow_artifact_location=home.mlflow_artifacts.as_uri(),
        parent_run_key=upstream.run_key if upstream else None,
        init_checkpoint=upstream.checkpoint if upstream else None, extra=extra,
    )
    from ghostvis_core.train.objectives import build_objective

    spec.extra["source_budget"] = preflight(cfg, p.steps, build_objective(spec, cfg))

    # The run key names what is trained, not how it is split over ranks: a resume on another world
    # size (same tokens_per_step) finds the same run and re-partitions the remaining rows exactly.
    ident_cfg = cfg.to_dict()
    for k in ("world_size", "micro_batch_size", "grad_accum_steps", "total_batch_tokens"):
        ident_cfg["batch"].pop(k)
    ident_cfg["batch"]["tokens_per_step"] = p.tokens_per_step
    identity = json.dumps({"config": ident_cfg, "tokenizer": tok.tokenizer_id,
                           "train": {s: [r["content_sha256"] for r in refs] for s, refs in train_shards.items()},
                           "upstream": upstream.checkpoint if upstream else None, "extra": extra}, sort_keys=True)
    digest = hashlib.sha256(identity.encode()).hexdigest()[:10]
    spec.run_key = _next_run_key(home, stage, f"{stage}@{variant}-{digest}" if variant else f"{stage}-{digest}")
    spec.checkpoint_dir = str(home.checkpoints(stage, spec.run_key))
    spec.tags = {"ghostvis.stage": stage, "ghostvis.run_key": spec.run_key, "ghostvis.preset": preset,
                 "ghostvis.tokenizer_id": tok.tokenizer_id,
                 **({"ghostvis.parent_run_key": upstream.run_key, "ghostvis.init_checkpoint": upstream.checkpoint,
                     "ghostvis.upstream_stage": upstream.stage} if upstream else {}),
                 **({"ghostvis.variant": variant} if variant else {})}
    spec.save(home.run_dir(stage, spec.run_key) / "spec.json")
    return spec


def _next_run_key(home: Home, stage: str, base: str) -> str:
    """base-r<n>: the newest unfinished attempt is resumed; after a finished one, a new attempt starts."""
    root = home.store / "checkpoints" / stage
    attempts = []
    if root.exists():
        for p in root.glob(f"{base}-r*"):
            m = re.fullmatch(re.escape(base) + r"-r(\d+)", p.name)
            if m:
                attempts.append((int(m.group(1)), p))
    if not attempts:
        return f"{base}-r1"
    n, path = max(attempts)
    return f"{base}-r{n}" if not (path / RUN_COMPLETE).exists() else f"{base}-r{n + 1}"


def spec_path(home: Home, spec: LaunchSpec) -> Path:
    return home.run_dir(spec.stage, spec.run_key) / "spec.json"


def error_file(home: Home, spec: LaunchSpec) -> Path:
    """Where a failed training process leaves its one-line reason for the launcher to show."""
    return home.run_dir(spec.stage, spec.run_key) / "error.txt"


def torchrun_command(spec_file: Path, nproc_per_node: int, python: str | None = None) -> list[str]:
    """The local launch: one node, `nproc_per_node` ranks, rendezvous on a free local port."""
    return [python or sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc_per_node}", "-m", "ghostvis_core.train", "--spec", str(spec_file)]


def launch_env(nproc_per_node: int) -> dict[str, str]:
    """Threads per rank: the machine's cores shared evenly (torchrun would default to 1 and warn)."""
    threads = max(1, (os.cpu_count() or 1) // nproc_per_node)
    return {"OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}

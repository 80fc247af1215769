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
from ghostvis_core.data.loader import LMBatcher
from ghostvis_core.data.stream import ShardRef, SourceStream
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
    """RUN_COMPLETE records of a stage, oldest first."""
    root = home.store / "checkpoints" / stage
    if not root.exists():
        return []
    recs = [json.loads(p.read_text()) for p in root.glob(f"*/{RUN_COMPLETE}")]
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


def preflight(cfg: StageConfig, plan_steps: int, train_shards: dict[str, list[dict]]) -> dict[str, dict[str, Any]]:
    """Per source: tokens the budget needs vs tokens available. Refuses to start on a shortfall."""
    bp = batch_plan(cfg.batch)
    streams = [SourceStream(s.source, [ShardRef.from_dict(r) for r in train_shards[s.source]], cfg.data.seed)
               for s in cfg.data.recipe]
    batcher = LMBatcher(streams, [s.weight for s in cfg.data.recipe], cfg.batch.seq_len)
    need = batcher.source_tokens(plan_steps * bp.rows_per_step)
    report, problems = {}, []
    for st in streams:
        needed = need[st.source] + 1
        shards = len(st.refs)
        epochs = needed / st.total
        report[st.source] = {"needed_tokens": needed, "available_tokens": st.total, "shards": shards,
                             "epochs": round(epochs, 3)}
        if needed > st.total and not cfg.data.allow_repeat:
            per_shard = st.total / shards
            more = math.ceil((needed - st.total) / per_shard)
            problems.append(
                f"source {st.source}: the budget needs {needed:,} tokens but {st.total:,} are tokenized in "
                f"{shards} shards ({epochs:.2f} epochs); tokenize about {more} more shards "
                f"(~{per_shard:,.0f} tokens each) or lower the budget, or set data.allow_repeat=true to repeat "
                f"the data {epochs:.2f} times"
            )
    if problems:
        raise GhostvisError("pre-flight failed: " + "; ".join(problems))
    return report


def prepare_run(
    stage: str,
    *,
    preset: str = "tiny",
    overrides: dict[str, Any] | None = None,
    home: Home | None = None,
    tokenizer_id: str | None = None,
    upstream: Upstream | None = None,
) -> LaunchSpec:
    home = home or Home.from_env()
    cfg = presets.resolve(stage, preset, overrides)
    tokenizer_id = tokenizer_id or newest_tokenizer(home)
    tok = load_tokenizer(tokenizer_id, home.store / "tokenizers")
    vocab = 64 * math.ceil(tok.vocab_size / 64)
    if "model.vocab_size" in (overrides or {}) and cfg.model.vocab_size != vocab:
        raise GhostvisError(f"model.vocab_size={cfg.model.vocab_size} does not fit tokenizer {tokenizer_id} "
                            f"({tok.vocab_size} tokens, padded to {vocab}); drop the override")
    cfg.model.vocab_size = vocab
    if cfg.init_from and upstream is None:
        upstream = find_upstream(home, cfg.init_from)

    ledger = Ledger(home.ledger)
    train_shards = select_shards(ledger, tok.tokenizer_id, [s.source for s in cfg.data.recipe], "train")
    val_shards = select_shards(ledger, tok.tokenizer_id, cfg.data.val_sources, "validation") if cfg.data.val_sources else {}
    p = make_plan(cfg)
    source_budget = preflight(cfg, p.steps, train_shards)

    identity = json.dumps({"config": cfg.to_dict(), "tokenizer": tok.tokenizer_id,
                           "train": {s: [r["content_sha256"] for r in refs] for s, refs in train_shards.items()},
                           "upstream": upstream.checkpoint if upstream else None}, sort_keys=True)
    digest = hashlib.sha256(identity.encode()).hexdigest()[:10]
    run_key = _next_run_key(home, stage, f"{stage}-{digest}")
    spec = LaunchSpec(
        stage=stage, run_key=run_key, config=cfg.to_dict(), plan=p.to_dict(), home=str(home.root),
        tokenizer_id=tok.tokenizer_id, tokenizer_dir=str(home.tokenizer_dir(tok.tokenizer_id)),
        train_shards=train_shards, val_shards=val_shards,
        checkpoint_dir=str(home.checkpoints(stage, run_key)), ledger_dir=str(home.ledger),
        mlflow_tracking_uri=home.mlflow_tracking_uri, mlflow_experiment=MLFLOW_EXPERIMENT,
        mlflow_artifact_location=home.mlflow_artifacts.as_uri(),
        parent_run_key=upstream.run_key if upstream else None,
        init_checkpoint=upstream.checkpoint if upstream else None,
        tags={"ghostvis.stage": stage, "ghostvis.run_key": run_key, "ghostvis.preset": preset,
              "ghostvis.tokenizer_id": tok.tokenizer_id,
              **({"ghostvis.parent_run_key": upstream.run_key, "ghostvis.init_checkpoint": upstream.checkpoint}
                 if upstream else {})},
        extra={"source_budget": source_budget},
    )
    spec.save(home.run_dir(stage, run_key) / "spec.json")
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

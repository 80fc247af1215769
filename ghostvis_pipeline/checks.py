"""Asset checks: the numbers are compared, not trusted. Each check's metadata shows what it compared.

Data: the tokenizer trained on no validation shard; the ledger matches a recount of the token
files, and every manifest shard is in it.
Training stages: consumed vs planned tokens, ledger == MLflow == materialization metadata,
no (shard, row range) consumed twice, no validation shard consumed in training.
"""



from dagster import AssetCheckResult, AssetCheckSeverity, MetadataValue, asset_check

from ghostvis_core.counts import MLFLOW_METRICS, TokenCounts
from ghostvis_core.data.catalog import recorded_sha256, registered_manifests, shard_split
from ghostvis_core.data.ledger import Ledger, duplicate_shards, train_validation_overlap
from ghostvis_core.data.sources import Manifest
from ghostvis_core.data.token_shard import TokenShard
from ghostvis_core.track.mlflow_records import latest_metrics
from ghostvis_core.errors import GhostvisError
from ghostvis_pipeline.metadata import latest_metadata, md_table
from ghostvis_pipeline.resources import GhostvisHome



@asset_check(asset="token_ledger", blocking=True, description="Ledger docs/tokens equal a recount of the token files.")
def ledger_matches_token_files(context, home: GhostvisHome) -> AssetCheckResult:
    h = home.home()
    tokenizer_id = latest_metadata(context, "tokenizer")["tokenizer_id"]
    mismatches, total = [], 0
    for r in Ledger.in_store(h.store).shards(tokenizer_id=tokenizer_id):
        try:
            shard = TokenShard.open(h.store.fetch("token_shard", tokenizer_id, r["shard_id"]), r["shard_id"])
            docs, tokens = len(shard.rows), shard.num_tokens
        except GhostvisError as exc:
            docs, tokens = -1, -1
            context.log.error(str(exc))
        total += tokens
        if (docs, tokens) != (r["docs"], r["tokens"]):
            mismatches.append([r["shard_id"], r["docs"], docs, r["tokens"], tokens])
    return AssetCheckResult(passed=not mismatches, metadata={
        "recounted_tokens": total, "mismatched_shards": len(mismatches),
        "mismatches": MetadataValue.md(md_table(["shard", "ledger_docs", "file_docs", "ledger_tokens", "file_tokens"], mismatches)),
    })


@asset_check(asset="token_ledger", blocking=True, description="Every shard in the manifests is tokenized with the current tokenizer.")
def all_manifest_shards_tokenized(context, home: GhostvisHome) -> AssetCheckResult:
    h = home.home()
    tokenizer_id = latest_metadata(context, "tokenizer")["tokenizer_id"]
    have = {r["shard_id"] for r in Ledger.in_store(h.store).shards(tokenizer_id=tokenizer_id)}
    want = [m.shard_id(e) for m in registered_manifests(h.store).values() for e in m.shards]
    missing = [s for s in want if s not in have]
    return AssetCheckResult(passed=not missing, metadata={
        "manifest_shards": len(want), "tokenized_shards": len(want) - len(missing),
        "missing": ", ".join(missing[:50]) or "none",
    })


@asset_check(asset="token_ledger", blocking=True,
             description="No two shards with the same content, and no document in both train and validation.")
def no_duplicate_content(context, home: GhostvisHome) -> AssetCheckResult:
    h = home.home()
    ledger = Ledger.in_store(h.store)
    tokenizer_id = latest_metadata(context, "tokenizer")["tokenizer_id"]
    dup_shards = duplicate_shards(ledger, tokenizer_id)
    overlap = train_validation_overlap(ledger, ledger.shards(tokenizer_id=tokenizer_id))
    return AssetCheckResult(passed=not dup_shards and not overlap, metadata={
        "duplicate_shards": len(dup_shards),
        "docs_in_train_and_validation": len(overlap),
        "duplicates": MetadataValue.md(md_table(["content_sha256", "shards"],
                                                [[d["content_sha256"][:16], ", ".join(d["shards"])] for d in dup_shards])),
        "leaked_docs": MetadataValue.md(md_table(
            ["validation shard", "row", "train shard", "row"],
            [[o["validation_shard"], o["validation_row"], o["train_shard"], o["train_row"]] for o in overlap[:100]])),
    })


@asset_check(asset="tokenizer", blocking=True,
             description="No shard whose split is validation (pinned by name or by sha256) is in the tokenizer's training set.")
def tokenizer_trained_on_train_shards_only(context, home: GhostvisHome) -> AssetCheckResult:
    store = home.home().store
    md = latest_metadata(context, "tokenizer")
    trained = list(md.get("train_shard_ids") or [])
    manifests = registered_manifests(store)
    validation = sorted(m.shard_id(e) for m in manifests.values() for e in m.shards
                        if _split_or_none(store, m, m.shard_id(e)) == "validation")
    offenders = []
    for sid in trained:
        manifest = manifests.get(sid.split("/", 1)[0])
        known = manifest is not None and any(manifest.shard_id(e) == sid for e in manifest.shards)
        split = _split_or_none(store, manifest, sid) if known else None
        if split != "train":
            offenders.append([sid, split or ("not downloaded: split unknown" if known else "in no manifest")])
    recorded = "train_shard_ids" in md
    return AssetCheckResult(passed=recorded and not offenders, metadata={
        "trained_shards": len(trained), "validation_shards": len(validation),
        "offending_shards": len(offenders),
        "offenders": MetadataValue.md(md_table(["shard", "split"], offenders)) if offenders else "none",
        "validation_shard_ids": ", ".join(validation[:100]) or "none",
        "note": "ok" if recorded else "the tokenizer's metadata has no train_shard_ids; re-materialize tokenizer",
    })


def _split_or_none(store, manifest: Manifest, shard_id: str) -> str | None:
    """The resolved split, or None for a shard that is not downloaded (it cannot have been read)."""
    if recorded_sha256(store, shard_id) is None and not store.exists("raw_shard", shard_id):
        return None
    return shard_split(store, manifest, shard_id)


def stage_checks(stage: str) -> list:
    """The four blocking checks of a training stage's materialization."""
    return [_tokens_match_plan(stage), _ledger_mlflow_metadata_agree(stage), _no_reuse(stage),
            _no_validation_leakage(stage)]


def _tokens_match_plan(stage: str):
    @asset_check(asset=stage, name="tokens_match_plan", blocking=True,
                 description="Consumed positions == steps x tokens_per_step, and that is within one step of planned_tokens.")
    def tokens_match_plan(context) -> AssetCheckResult:
        md = latest_metadata(context, stage)
        tps, steps, planned = md["tokens_per_step"], md["steps"], md["planned_tokens"]
        consumed = TokenCounts.from_mapping(md).consumed
        step_tokens = steps * tps
        passed = consumed == step_tokens and 0 <= step_tokens - planned < tps
        return AssetCheckResult(passed=passed, metadata={
            "planned_tokens": planned, "consumed_tokens": consumed, "steps_x_tokens_per_step": step_tokens,
            "tolerance_tokens": tps, "difference": step_tokens - planned,
            "tokens_per_step": f"{md['micro_batch_size']} x {md['seq_len']} x {md['world_size']} x {md['grad_accum_steps']} = {tps}",
        })

    return tokens_match_plan


def _ledger_mlflow_metadata_agree(stage: str):
    @asset_check(asset=stage, name="ledger_mlflow_metadata_agree", blocking=True,
                 description="real/pad/loss/cropped tokens: ledger == MLflow == materialization metadata, exactly.")
    def ledger_mlflow_metadata_agree(context, home: GhostvisHome) -> AssetCheckResult:
        h = home.home()
        md = latest_metadata(context, stage)
        ledger = Ledger.in_store(h.store).run_totals(md["run_key"])
        metrics = latest_metrics(h.mlflow_tracking_uri, md["mlflow_run_id"])
        rows, passed = [], True
        for k in TokenCounts.names():
            vals = [ledger.get(k), metrics.get(MLFLOW_METRICS[k]), md.get(k)]
            vals = [None if v is None else int(v) for v in vals]
            ok = vals[0] is not None and vals[0] == vals[1] == vals[2]
            passed &= ok
            rows.append([k, *vals, "ok" if ok else "MISMATCH"])
        return AssetCheckResult(passed=passed, metadata={
            "run_key": md["run_key"], "segments": str(ledger.get("segments")),
            "comparison": MetadataValue.md(md_table(["figure", "ledger", "mlflow", "metadata", "status"], rows)),
        })

    return ledger_mlflow_metadata_agree


def _no_reuse(stage: str):
    @asset_check(asset=stage, name="no_reuse", blocking=True,
                 description="No (shard, row range) consumed twice in the stage lineage unless declared (replay / allowed repeat).")
    def no_reuse(context, home: GhostvisHome) -> AssetCheckResult:
        md = latest_metadata(context, stage)
        found = Ledger.in_store(home.home().store).reuse(md["run_key"])
        bad = [r for r in found if r["kind"] in ("reuse", "undeclared_repeat", "undeclared_cross_stage")]
        declared = [r for r in found if r not in bad]
        rows = [[r["kind"], r["shard_id"], f"{r['tok_start']}..{r['tok_end']}", f"{r['row_start']}..{r['row_end']}",
                 r["tokens"], r["run_a"], r["run_b"]] for r in found[:200]]
        return AssetCheckResult(passed=not bad, severity=AssetCheckSeverity.ERROR, metadata={
            "reused_tokens": sum(r["tokens"] for r in bad),
            "declared_replay_or_repeat_tokens": sum(r["tokens"] for r in declared),
            "ranges": MetadataValue.md(md_table(["kind", "shard", "tokens_range", "rows", "tokens", "run_a", "run_b"], rows)),
        })

    return no_reuse


def _no_validation_leakage(stage: str):
    @asset_check(asset=stage, name="no_validation_leakage", blocking=True,
                 description="No validation shard was consumed in training.")
    def no_validation_leakage(context, home: GhostvisHome) -> AssetCheckResult:
        md = latest_metadata(context, stage)
        leaked = Ledger.in_store(home.home().store).leakage(md["run_key"])
        return AssetCheckResult(passed=not leaked, metadata={
            "leaked_tokens": sum(r["tokens"] for r in leaked),
            "leaked_shards": ", ".join(r["shard_id"] for r in leaked) or "none",
        })

    return no_validation_leakage

"""Asset checks: the numbers are compared, not trusted. Each check's metadata shows what it compared.

The checks' logic lives in ghostvis_core.audit.invariants (plain functions that `ghostvis audit` calls
too); these wrap them for Dagster. Data: the tokenizer trained on no validation shard; the ledger
matches a recount of the token files, and every manifest shard is in it. Training stages: the four
figures recounted from the token files, the consumption the plan expected, the selection, every
rank's share, consumed vs planned tokens, ledger == MLflow == run record == metadata, no range read
twice, no validation shard consumed.
"""

from dagster import AssetCheckResult, MetadataValue, asset_check

from ghostvis_core.audit import invariants as inv
from ghostvis_core.audit.outcome import CheckOutcome
from ghostvis_core.data.catalog import recorded_sha256, registered_manifests, shard_split
from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.sources import Manifest
from ghostvis_core.track.mlflow_records import latest_metrics
from ghostvis_pipeline.metadata import latest_metadata, md_table
from ghostvis_pipeline.resources import GhostvisHome


def to_result(outcome: CheckOutcome) -> AssetCheckResult:
    """A core check's outcome as Dagster metadata: its figures, its tables as Markdown, its failures."""
    metadata = dict(outcome.figures)
    metadata.update({name: MetadataValue.md(md_table(header, rows)) for name, (header, rows) in outcome.tables.items()})
    if outcome.failures:
        metadata["failures"] = MetadataValue.md("\n".join(f"- {f}" for f in outcome.failures[:100]))
    return AssetCheckResult(passed=outcome.passed, metadata=metadata)


@asset_check(asset="token_ledger", blocking=True, description="Ledger docs/tokens equal a recount of the token files.")
def ledger_matches_token_files(context, home: GhostvisHome) -> AssetCheckResult:
    h = home.home()
    tokenizer_id = latest_metadata(context, "tokenizer")["tokenizer_id"]
    return to_result(inv.ledger_matches_token_files(h.store, Ledger.in_store(h.store), tokenizer_id))


@asset_check(asset="token_ledger", blocking=True, description="Every shard in the manifests is tokenized with the current tokenizer.")
def all_manifest_shards_tokenized(context, home: GhostvisHome) -> AssetCheckResult:
    h = home.home()
    tokenizer_id = latest_metadata(context, "tokenizer")["tokenizer_id"]
    return to_result(inv.all_manifest_shards_tokenized(h.store, Ledger.in_store(h.store), tokenizer_id))


@asset_check(asset="token_ledger", blocking=True,
             description="No two shards with the same content, and no document in both train and validation.")
def no_duplicate_content(context, home: GhostvisHome) -> AssetCheckResult:
    h = home.home()
    tokenizer_id = latest_metadata(context, "tokenizer")["tokenizer_id"]
    return to_result(inv.no_duplicate_content(Ledger.in_store(h.store), tokenizer_id))


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


# name -> (description, the core check of one run: (store, ledger, run, context, metadata) -> CheckOutcome)
STAGE_CHECKS = {
    "tokens_recounted_from_files": (
        "real/pad/loss/cropped recounted from the token files over the consumed ranges == the trainer's, per segment "
        "and in total; every range inside its file and on the row rule; no token read twice.",
        lambda store, ledger, run, md, h: inv.tokens_recounted_from_files(store, run)),
    "consumption_matches_plan": (
        "The rows and shard ranges the plan (steps, tokens_per_step, mixture) says the run had to read are exactly "
        "the recorded ones: no gap, no overlap, no shift; consumed == steps x tokens_per_step, within a step of plan.",
        lambda store, ledger, run, md, h: inv.consumption_matches_plan(store, run)),
    "no_validation_selected": (
        "The run's selected training shards (its launch spec) contain no validation shard.",
        lambda store, ledger, run, md, h: inv.no_validation_selected(ledger, run)),
    "every_rank_read_its_rows": (
        "Every part keeps each rank's share: exactly the rows that rank had to read each step, summing to the part.",
        lambda store, ledger, run, md, h: inv.every_rank_read_its_rows(ledger, run)),
    "tokens_match_plan": (
        "Consumed positions == steps x tokens_per_step, and that is within one step of planned_tokens.",
        lambda store, ledger, run, md, h: inv.tokens_match_plan(md)),
    "ledger_mlflow_metadata_agree": (
        "real/pad/loss/cropped tokens: ledger == MLflow == run record == materialization metadata, exactly.",
        lambda store, ledger, run, md, h: inv.figures_agree(
            ledger, run, latest_metrics(h.mlflow_tracking_uri, md["mlflow_run_id"]), md)),
    "no_reuse": (
        "No (shard, row range) consumed twice in the stage lineage unless declared (replay / allowed repeat).",
        lambda store, ledger, run, md, h: inv.no_reuse(ledger, md["run_key"])),
    "no_validation_leakage": (
        "No validation shard was consumed in training.",
        lambda store, ledger, run, md, h: inv.no_validation_leakage(ledger, md["run_key"])),
}


def stage_checks(stage: str) -> list:
    """The blocking checks of a training stage's materialization (STAGE_CHECKS), each reading the newest
    materialization's run from the store: they re-run without retraining (the checks-only job)."""
    return [_stage_check(stage, name, description, run_check)
            for name, (description, run_check) in STAGE_CHECKS.items()]


def _stage_check(stage: str, name: str, description: str, run_check):
    @asset_check(asset=stage, name=name, blocking=True, description=description)
    def check(context, home: GhostvisHome) -> AssetCheckResult:
        h = home.home()
        md = latest_metadata(context, stage)
        ledger = Ledger.in_store(h.store)
        run = inv.StageRun.load(h.store, ledger, stage, md["run_key"])
        return to_result(run_check(h.store, ledger, run, md, h))

    return check

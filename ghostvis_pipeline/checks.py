"""Asset checks: the numbers are compared, not trusted. Each check's metadata shows what it compared.

The checks' logic lives in ghostvis_core.audit.invariants (plain functions that `ghostvis audit` calls
too); these wrap them for Dagster. Data: the tokenizer trained on no validation shard; the ledger
matches a recount of the token files, and every manifest shard is in it. Training stages: the four
figures recounted from the token files, the consumption the plan expected, the selection, every
rank's share, consumed vs planned tokens, ledger == MLflow == run record == metadata, no range read
twice, no validation shard consumed. Evaluation: no stage beyond its held-out bpb tolerance against
its upstream (non-blocking: a judgement on the model, not on the accounting).
"""

from dagster import AssetCheckResult, MetadataValue, asset_check

from ghostvis_core.audit import invariants as inv
from ghostvis_core.audit.outcome import CheckOutcome
from ghostvis_core.audit.stage_checks import STAGE_CHECKS, CheckInputs
from ghostvis_core.data.catalog import recorded_sha256, registered_manifests, shard_split
from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.sources import Manifest
from ghostvis_core.eval.gate import lineage_gate
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


@asset_check(asset="evaluation", blocking=False,
             description="No stage scores more bits per byte than its upstream times (1 + its tolerance) on any "
                         "held-out text source (the lineage quality gate).")
def lineage_quality_gate(context, home: GhostvisHome) -> AssetCheckResult:
    """One check on the evaluation rather than one per stage: the held-out scores of a stage and its
    upstream exist together only once the evaluation has scored the lineage. Non-blocking, so the
    report card is still written, with the flagged stages in it."""
    md = latest_metadata(context, "evaluation")
    results = home.home().store.read_json("report", f"evaluation/{md['identity']}.json")
    verdict = lineage_gate({stage: r["bpb"] for stage, r in results.items()}, dict(md["bpb_tolerance"]))
    return to_result(CheckOutcome("lineage_quality_gate", verdict.passed, verdict.figures,
                                  {"bpb_vs_upstream": verdict.table()}, verdict.failures))


def _split_or_none(store, manifest: Manifest, shard_id: str) -> str | None:
    """The resolved split, or None for a shard that is not downloaded (it cannot have been read)."""
    if recorded_sha256(store, shard_id) is None and not store.exists("raw_shard", shard_id):
        return None
    return shard_split(store, manifest, shard_id)


def stage_checks(stage: str) -> list:
    """The blocking checks of a training stage's materialization (STAGE_CHECKS), each reading the newest
    materialization's run from the store: they re-run without retraining (the checks-only job)."""
    return [_stage_check(stage, name, description, run_check) for name, description, run_check in STAGE_CHECKS]


def _stage_check(stage: str, name: str, description: str, run_check):
    @asset_check(asset=stage, name=name, blocking=True, description=description)
    def check(context, home: GhostvisHome) -> AssetCheckResult:
        h = home.home()
        md = latest_metadata(context, stage)
        ledger = Ledger.in_store(h.store)
        run = inv.StageRun.load(h.store, ledger, stage, md["run_key"])
        return to_result(run_check(CheckInputs(h, ledger, run, md)))

    return check

"""Asset checks: the numbers are compared, not trusted. Each check's metadata shows what it compared.

The checks' logic lives in ghostvis_core.verify.audit.invariants (plain functions that `ghostvis audit` calls
too); these wrap them for Dagster. Data: the tokenizer trained on no validation shard; the ledger
matches a recount of the token files, every manifest shard is in it, and tokens before
tokenization = tokens kept + tokens removed. Training stages: the four
figures recounted from the token files, the consumption the plan expected, the selection, every
rank's share, consumed vs planned tokens, ledger == MLflow == run record == metadata, no range read
twice, no validation shard consumed; and, non-blocking, `replay_matches`: sampled checkpoint intervals
replayed on the ledger's rows and compared bit for bit with the checkpoint after them. Evaluation: no stage
beyond its held-out bpb tolerance against its upstream (non-blocking: a judgement on the model, not on the accounting).
"""

import dataclasses

from dagster import AssetCheckResult, MetadataValue, asset_check

from ghostvis_core.data.catalog import recorded_sha256, registered_manifests, shard_split
from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.shard_manifest import Manifest
from ghostvis_core.verify.audit import invariants as inv
from ghostvis_core.verify.audit.check_outcome import CheckOutcome
from ghostvis_core.verify.audit.data_checks import DATA_CHECKS
from ghostvis_core.verify.audit.stage_checks import STAGE_CHECKS, CheckInputs
from ghostvis_core.verify.eval.quality_gate import lineage_gate
from ghostvis_core.verify.replay.check import NAME, kept_verdict, replay_matches
from ghostvis_core.verify.replay.refusal import refusal
from ghostvis_core.verify.replay.settings import ReplaySettings
from ghostvis_pipeline.check_verdict import settle_check
from ghostvis_pipeline.config import config_from_dataclass
from ghostvis_pipeline.metadata import latest_metadata, md_table
from ghostvis_pipeline.resources import GhostvisHome

ReplayConfig = config_from_dataclass(ReplaySettings)

# A check's table shows its first rows only, so its event stays bounded at any number of shards.
TABLE_ROWS = 20


def to_result(outcome: CheckOutcome) -> AssetCheckResult:
    """A core check's outcome as Dagster metadata: its figures, its tables as Markdown, its failures."""
    metadata = dict(outcome.figures)
    metadata.update({name: capped_table(header, rows) for name, (header, rows) in outcome.tables.items()})
    if outcome.failures:
        metadata["failures"] = MetadataValue.md("\n".join(f"- {f}" for f in outcome.failures[:100]))
    return AssetCheckResult(passed=outcome.passed, metadata=metadata)


def said(context, asset: str, outcome: CheckOutcome, audit: str) -> CheckOutcome:
    """The outcome, its failures first logged as `ghostvis audit` prints them (`asset: check: what disagrees`):
    Dagster's own line for a failed check names only the check. `audit`: the command with every figure."""
    if not outcome.passed:
        lines = [f"{asset}: {outcome.name}: {f}" for f in outcome.failures[:TABLE_ROWS]] or [f"{asset}: {outcome.name}"]
        more = len(outcome.failures) - len(lines)
        lines += [f"... and {more:,} more"] if more > 0 else []
        context.log.error("\n".join([*lines, f"(every figure and table: `{audit}`)"]))
    return outcome


def capped_table(header: list[str], rows: list[list]) -> MetadataValue:
    """The first TABLE_ROWS rows as Markdown and how many more there are (`ghostvis audit --json` has every row)."""
    more = len(rows) - TABLE_ROWS
    note = f"\n\n... and {more:,} more rows (every row: `ghostvis audit --json`)" if more > 0 else ""
    return MetadataValue.md(md_table(header, rows[:TABLE_ROWS]) + note)


def data_checks() -> list:
    """The blocking checks of the token ledger (DATA_CHECKS), for the newest tokenizer's shards."""
    return [_data_check(name, description, run_check) for name, description, run_check in DATA_CHECKS]


def _data_check(name: str, description: str, run_check):
    @asset_check(asset="token_ledger", name=name, blocking=True, description=description)
    def check(context, home: GhostvisHome) -> AssetCheckResult:
        h = home.home()
        tokenizer_id = latest_metadata(context, "tokenizer")["tokenizer_id"]
        outcome = run_check(h.store, Ledger.in_store(h.store), tokenizer_id)
        return to_result(said(context, "token_ledger", outcome, "ghostvis audit"))

    return check


@asset_check(
    asset="tokenizer",
    blocking=True,
    description="No shard whose split is validation (pinned by name or by sha256) is in the tokenizer's training set.",
)
def tokenizer_trained_on_train_shards_only(context, home: GhostvisHome) -> AssetCheckResult:
    store = home.home().store
    md = latest_metadata(context, "tokenizer")
    trained = _tokenizer_train_shard_ids(store, md)
    recorded = trained is not None
    trained = trained or []
    manifests = registered_manifests(store)
    validation = sorted(
        m.shard_id(e)
        for m in manifests.values()
        for e in m.shards
        if _split_or_none(store, m, m.shard_id(e)) == "validation"
    )
    offenders = []
    for sid in trained:
        manifest = manifests.get(sid.split("/", 1)[0])
        known = manifest is not None and sid in manifest.entries_by_id
        split = _split_or_none(store, manifest, sid) if known else None
        if split != "train":
            offenders.append([sid, split or ("not downloaded: split unknown" if known else "in no manifest")])
    return AssetCheckResult(
        passed=recorded and not offenders,
        metadata={
            "trained_shards": len(trained),
            "validation_shards": len(validation),
            "offending_shards": len(offenders),
            "offenders": capped_table(["shard", "split"], offenders) if offenders else "none",
            "validation_shard_ids": ", ".join(validation[:100]) or "none",
            "note": "ok"
            if recorded
            else "the tokenizer's identity record (metadata `identity`) with its train shards "
            "is not in the store; re-materialize tokenizer",
        },
    )


def _tokenizer_train_shard_ids(store, md: dict) -> list[str] | None:
    """The shards the tokenizer trained on, from its identity record in the store (assets/data.py keeps the list
    there, not in the event); [] for a tokenizer taken from a model or a file; None when no record says."""
    if md.get("from_model") or md.get("from_file"):
        return []
    key = md.get("identity")
    if not key or not store.exists("identity", "tokenizer", key):
        return None
    return list(store.read_json("identity", "tokenizer", key)["metadata"]["train_shard_ids"])


@asset_check(
    asset="evaluation",
    blocking=False,
    description="No stage scores more bits per byte than its upstream times (1 + its tolerance) on any "
    "held-out text source (the lineage quality gate).",
)
def lineage_quality_gate(context, home: GhostvisHome) -> AssetCheckResult:
    """One check on the evaluation rather than one per stage: the held-out scores of a stage and its
    upstream exist together only once the evaluation has scored the lineage. Non-blocking, so the
    report card is still written, with the flagged stages in it."""
    md = latest_metadata(context, "evaluation")
    results = home.home().store.read_json("report", f"evaluation/{md['identity']}.json")
    verdict = lineage_gate({stage: r["bpb"] for stage, r in results.items()}, dict(md["bpb_tolerance"]))
    return to_result(
        CheckOutcome(
            "lineage_quality_gate",
            verdict.passed,
            verdict.figures,
            {"bpb_vs_upstream": verdict.table()},
            verdict.failures,
        )
    )


def _split_or_none(store, manifest: Manifest, shard_id: str) -> str | None:
    """The resolved split, or None for a shard that is not downloaded (it cannot have been read)."""
    if recorded_sha256(store, shard_id) is None and not store.exists("raw_shard", shard_id):
        return None
    return shard_split(store, manifest, shard_id)


def stage_checks(stage: str) -> list:
    """The blocking checks of a training stage's materialization (STAGE_CHECKS), each reading the newest
    materialization's run from the store: they re-run without retraining (the checks-only job). Each keeps
    its outcome beside the run, and the run's verdict reaches MLflow (check_verdict.py)."""
    return [_stage_check(stage, name, description, run_check) for name, description, run_check in STAGE_CHECKS]


def _stage_check(stage: str, name: str, description: str, run_check):
    @asset_check(asset=stage, name=name, blocking=True, description=description)
    def check(context, home: GhostvisHome) -> AssetCheckResult:
        h = home.home()
        md = latest_metadata(context, stage)
        ledger = Ledger.in_store(h.store)
        run = inv.StageRun.load(h.store, ledger, stage, md["run_key"])
        outcome = said(context, stage, run_check(CheckInputs(h, ledger, run, md)), f"ghostvis audit --stage {stage}")
        settle_check(context, h, stage, md, name, outcome)
        return to_result(outcome)

    return check


def replay_check(stage: str):
    """The non-blocking `replay_matches` check of a stage whose runs can be replayed (ghostvis_core/verify/replay):
    K intervals (config `intervals`, drawn with `seed`) of the materialization's run, each compared bit for bit."""

    @asset_check(
        asset=stage,
        name=NAME,
        blocking=False,
        description="Sampled checkpoint intervals of the run replayed from the checkpoint before them on the rows "
        "the ledger recorded (built by the audit's reader) equal the checkpoint after them, bit for bit.",
    )
    def check(context, config: ReplayConfig, home: GhostvisHome) -> AssetCheckResult:
        h, md = home.home(), latest_metadata(context, stage)
        run = inv.StageRun.load(h.store, Ledger.in_store(h.store), stage, md["run_key"])
        settings = ReplaySettings(config.intervals, config.seed)
        kept = kept_verdict(h.store, run, settings) if "cached_from" in md else None  # a cache hit replays nothing
        outcome = kept or replay_matches(h.store, run, settings)
        if refusal(run) is not None:  # a GPU, fsdp or async-save run: nothing replayed is no fault of the run
            outcome = dataclasses.replace(outcome, passed=True)
        return to_result(outcome)

    return check

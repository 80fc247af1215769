"""The `trace` job: `ghostvis trace` from the UI (Launchpad: `doc` as <shard>:<row>, or `text`, or
`stage` and `step`); the answer (ghostvis_core/verify/trace.py) is the op's output metadata, as JSON."""

from dagster import Config, Failure, MetadataValue, OpExecutionContext, job, op

from ghostvis_core.errors import GhostvisError
from ghostvis_pipeline.resources import GhostvisHome


class TraceConfig(Config):
    doc: str | None = None  # <shard>:<row>
    text: str | None = None  # 20 words or more of a document
    stage: str | None = None  # with step: what that step fed
    step: int | None = None
    run_key: str | None = None  # with stage: the run (None: the stage's newest completed run)


def answer(home, config: TraceConfig) -> dict:
    from ghostvis_core.data.ledger import Ledger
    from ghostvis_core.verify.trace import find_text, shard_row, trace_document, trace_step

    ledger, uri = Ledger.in_store(home.store), home.mlflow_tracking_uri
    if config.doc:
        return trace_document(home.store, ledger, *shard_row(config.doc), uri)
    if config.text:
        found = find_text(home.store, ledger, config.text)
        return {
            "found": found,
            "traces": [trace_document(home.store, ledger, d["shard_id"], d["row"], uri) for d in found],
        }
    if config.stage and config.step:
        return trace_step(home.store, ledger, config.stage, config.step, config.run_key)
    raise GhostvisError("trace job: give doc (<shard>:<row>), text, or stage and step in the op config")


@op
def trace_ledger(context: OpExecutionContext, config: TraceConfig, home: GhostvisHome) -> dict:
    try:
        report = answer(home.home(), config)
    except GhostvisError as exc:
        raise Failure(description=f"trace: {exc}", allow_retries=False) from None
    context.add_output_metadata({"trace": MetadataValue.json(report)})
    return report


@job(description="Where a document went (config doc or text), or what a step fed (stage, step): ghostvis trace")
def trace():
    trace_ledger()

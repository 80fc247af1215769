"""The one list of a training stage's checks: the Dagster asset checks, the checks-only job and
`ghostvis audit` all run exactly these, in this order, so a check in the UI and an audit from a
terminal cannot disagree or drift apart.

Each entry is (name, description, check): the check reads a `CheckInputs` (the store, the ledger,
the run's records, MLflow, and the Dagster metadata when there is one) and returns a CheckOutcome.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ghostvis_core.counts import MLFLOW_METRICS
from ghostvis_core.data.ledger import Ledger
from ghostvis_core.home import Home
from ghostvis_core.run.track.mlflow_records import latest_metrics, metric_histories
from ghostvis_core.verify.audit import invariants as inv
from ghostvis_core.verify.audit.check_outcome import CheckOutcome
from ghostvis_core.verify.audit.contamination import no_eval_contamination
from ghostvis_core.verify.audit.content import fed_content_matches_files
from ghostvis_core.verify.audit.rollouts import rollouts_recounted


@dataclass
class CheckInputs:
    """What a stage check may read. `metadata` is the materialization's Dagster metadata (None when
    the audit runs without Dagster); `mlflow` the run's newest MLflow metrics, read once on first use."""

    home: Home
    ledger: Ledger
    run: inv.StageRun
    metadata: dict[str, Any] | None = None
    _mlflow: dict[str, float] | None = field(default=None, repr=False)
    _history: dict[str, list[tuple[int, float]]] | None = field(default=None, repr=False)

    @property
    def mlflow(self) -> dict[str, float]:
        if self._mlflow is None:
            self._mlflow = latest_metrics(self.home.mlflow_tracking_uri, self.run.record.mlflow_run_id)
        return self._mlflow

    @property
    def token_history(self) -> dict[str, list[tuple[int, float]]]:
        """Every MLflow point of the four token metrics, (step, value) per metric, read once on first use."""
        if self._history is None:
            self._history = metric_histories(
                self.home.mlflow_tracking_uri, self.run.record.mlflow_run_id, tuple(MLFLOW_METRICS.values())
            )
        return self._history

    def figures(self) -> dict[str, Any]:
        """tokens_per_step, steps, planned_tokens and the four figures: the metadata's when there is
        one (what Dagster shows), else the trainer's run record."""
        if self.metadata is not None:
            return self.metadata
        r = self.run.record
        return {
            "tokens_per_step": r.batch.tokens_per_step,
            "steps": r.steps,
            "planned_tokens": r.planned_tokens,
            **r.counts.as_dict(),
        }


StageCheck = tuple[str, str, Callable[[CheckInputs], CheckOutcome]]

STAGE_CHECKS: list[StageCheck] = [
    (
        "tokens_recounted_from_files",
        "real/pad/loss/cropped recounted from the token files over the consumed ranges == the trainer's, per segment "
        "and in total; every range inside its file and on the row rule; no token read twice.",
        lambda c: inv.tokens_recounted_from_files(c.home.store, c.run),
    ),
    (
        "fed_content_matches_files",
        "What every rank fed the model each step (content digests of each micro-batch, in the ledger) equals the "
        "rows the plan says it had to read, rebuilt from the token files by the audit's own reader.",
        lambda c: fed_content_matches_files(c.home.store, c.ledger, c.run.spec.to_dict(), c.run.chain),
    ),
    (
        "rollouts_recounted",
        "rl: generated, rewarded tokens and completions recounted from the saved rollouts (each reward recomputed from "
        "its completion and the answer in the token file), prompts from the token files == ledger == run record == "
        "MLflow == metadata; other stages record no rollouts.",
        lambda c: rollouts_recounted(c.home.store, c.ledger, c.run, c.mlflow, c.metadata),
    ),
    (
        "consumption_matches_plan",
        "The rows and shard ranges the plan (steps, tokens_per_step, mixture) says the run had to read are exactly "
        "the recorded ones: no gap, no overlap, no shift; consumed == steps x tokens_per_step, within a step of plan.",
        lambda c: inv.consumption_matches_plan(c.home.store, c.run),
    ),
    (
        "no_validation_selected",
        "The run's selected training shards (its launch spec) are all train in the ledger's shard table.",
        lambda c: inv.no_validation_selected(c.ledger, c.run),
    ),
    (
        "every_rank_read_its_rows",
        "Every part keeps each rank's share: exactly the rows that rank had to read each step, summing to the part.",
        lambda c: inv.every_rank_read_its_rows(c.ledger, c.run),
    ),
    (
        "ledger_mlflow_metadata_agree",
        "real/pad/loss/cropped tokens: ledger == MLflow == run record == materialization metadata, exactly.",
        lambda c: inv.figures_agree(c.ledger, c.run, c.mlflow, c.metadata),
    ),
    (
        "mlflow_token_history",
        "Every MLflow point of the token metrics: none falls, real + pad == step x tokens_per_step, and at each "
        "committed step each figure == the ledger's cumulative figure up to that part.",
        lambda c: inv.mlflow_token_history(c.run.chain, c.run.spec.plan.batch.tokens_per_step, c.token_history),
    ),
    (
        "tokens_match_plan",
        "Consumed positions == steps x tokens_per_step, and that is within one step of planned_tokens.",
        lambda c: inv.tokens_match_plan(c.figures()),
    ),
    (
        "no_reuse",
        "No (shard, row range) consumed twice in the stage lineage unless declared (replay / allowed repeat).",
        lambda c: inv.no_reuse(c.ledger, c.run.spec.run_key),
    ),
    (
        "no_validation_leakage",
        "No consumed shard is anything but train in the ledger's shard table, in the version the run read (never "
        "the trainer's split label).",
        lambda c: inv.no_validation_leakage(
            c.ledger, c.run.spec.run_key, c.run.spec.tokenizer_id, c.run.spec.shard_versions()
        ),
    ),
    (
        "no_eval_contamination",
        "No consumed training document shares more than contamination.max_overlap of its or an evaluation item's "
        "13-gram fingerprints with that item, or holds an item shorter than 13 words whole (validation shards, "
        "lm-eval tasks, benchmark, prompts, registered sets); rl completions by fingerprints (one writing a short "
        "item whole is listed: a right answer, not eval text); every evaluation set has an item that can be checked.",
        lambda c: no_eval_contamination(c.home.store, c.ledger, c.run.spec, c.run.consumption, c.run.chain),
    ),
]


def stage_check_names() -> list[str]:
    return [name for name, _, _ in STAGE_CHECKS]

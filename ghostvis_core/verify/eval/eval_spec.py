"""The evaluation job's spec: what the `evaluation` asset plans on the Dagster host and the job
(`python -m ghostvis_core.verify.eval`) scores, wherever the launcher runs it.

The asset writes it once, at runs/evaluation/<identity>/spec.json in the store; the job writes its results to
reports/evaluation/<identity>.json, which is also how a later materialization finds the lineage scored.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from ghostvis_core.runs.job_command import Job

if TYPE_CHECKING:
    from ghostvis_core.data.ledger.records import ShardRecord

EVAL_FOLDER = "evaluation"  # the jobs' folder in the store, as a stage's runs have theirs (runs/evaluation/<key>/)
MODULE = "ghostvis_core.verify.eval"
MAX_BPB_TOKENS, MC_PER_TASK = 8192, 25  # held-out tokens scored per source; benchmark items per task


@dataclass(frozen=True)
class EvalSpec:
    key: str  # the evaluation's identity (what was scored): its results' name
    store: str  # the store's URI
    mlflow_tracking_uri: str  # each stage's MLflow run gets its scores
    tokenizer_id: str
    lineage: dict[str, str]  # stage -> run key, in the lineage's order
    held_out: dict[str, list[dict[str, str]]]  # source -> its held-out text shards (shard_id, content_sha256)
    harness_tasks: list[str]
    harness_include: list[str]  # folders of the user's task YAML

    def to_dict(self) -> dict:
        """The lineage and the held-out sources as [name, value] pairs: the store writes an object's keys
        sorted, and the scores keep the lineage's order and each stage's bpb the sources' order."""
        return {**asdict(self), "lineage": list(self.lineage.items()), "held_out": list(self.held_out.items())}

    @classmethod
    def from_dict(cls, d: dict) -> EvalSpec:
        return cls(**{**d, "lineage": dict(d["lineage"]), "held_out": dict(d["held_out"])})


def held_out_refs(shards: dict[str, list[ShardRecord]]) -> dict[str, list[dict[str, str]]]:
    """The spec's held-out shards (`EvalSpec.held_out`) from their ledger records: what the job fetches
    each by (shard_id, content_sha256), and the token path the ledger holds."""
    return {
        source: [{"shard_id": r.shard_id, "content_sha256": r.content_sha256, "path": r.token_path} for r in records]
        for source, records in shards.items()
    }


def results_name(key: str) -> str:
    """The `report` name of an evaluation's results (stage -> its scores)."""
    return f"{EVAL_FOLDER}/{key}.json"


def eval_job(spec: EvalSpec) -> Job:
    """The evaluation as a launcher's job: one rank (it scores the stages side by side on its threads)."""
    return Job(
        stage=EVAL_FOLDER,
        run_key=spec.key,
        module=MODULE,
        ranks=1,
        mlflow_tracking_uri=spec.mlflow_tracking_uri,
        done=("report", results_name(spec.key)),
    )

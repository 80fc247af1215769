"""The ledger's rows as typed records, one frozen dataclass per table: what the queries return and, for
the part row, what the trainer writes. Each table's Parquet schema is derived from its record's fields
(`schema_of`), so a column is named and typed in one place; the field order is the files' column order.

A field whose metadata says `json` is a list kept as a JSON string in its column (Parquet has no ragged
lists the ledger's readers agree on): the query decodes it, so the record holds the list.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, fields
from functools import cache
from operator import attrgetter
from typing import Any, get_type_hints

import pyarrow as pa

from ghostvis_core.counts import TokenCounts
from ghostvis_core.data.shard_piece import Piece
from ghostvis_core.plan.batch import BatchPlan

# The tables written per part of a run, each in a folder per run (`LedgerFiles.part_file`).
PART_TABLES = ("parts", "consumption", "shares", "feeds", "rollouts", "checkpoint_files")

NGRAM_INDEX_ROWS = 65_536  # rows per row group of the fingerprint index: a lookup reads the groups its hashes fall in
NGRAM_INDEX_FILES = b"ghostvis.ngram_files"  # the index file's metadata: the ngrams/ file names it holds (JSON)

_ARROW = {str: pa.string(), int: pa.int64(), float: pa.float64(), bool: pa.bool_()}


def _json() -> Any:
    """A field kept as a JSON string in its column and decoded on read."""
    return field(metadata={"json": True})


@dataclass(frozen=True, kw_only=True)
class ShardRecord:
    """What one tokenized shard holds: docs, tokens, bytes and what was dropped (the `shards` table).
    Read back, `token_path` is absolute (it is kept relative to the store folder); written, the
    writer fills `token_sha256` from the token file (`LedgerWriter.write_shard`)."""

    shard_id: str
    source: str
    split: str
    kind: str
    content_sha256: str
    replaces_sha256: str = ""  # the shard's content before this version ("": its first version)
    raw_bytes: int
    tokenizer_id: str
    docs: int
    tokens: int
    text_bytes: int
    docs_dropped: int = 0
    tokens_dropped: int = 0
    drop_reasons: str = "{}"  # JSON {reason: {"docs": n, "tokens": n}}
    token_path: str
    token_sha256: str = ""  # of the token file as written: a replaced file shows
    created_at: float = field(default_factory=time.time)


@dataclass(frozen=True)
class PartRow:
    """One checkpointed part of a run segment (the `parts` table): its steps and rows, the four token
    figures summed over ranks, the tokens_per_step factors; `prev_part_id` chains the parts that lead to
    a checkpoint. The trainer builds it without the counts (`with_counts` adds the ranks' sums)."""

    part_id: str
    prev_part_id: str
    run_key: str
    parent_run_key: str
    stage: str
    segment: int
    step_first: int
    step_last: int
    rows_first: int
    rows_last: int
    real_tokens: int = 0
    pad_tokens: int = 0
    loss_tokens: int = 0
    cropped_tokens: int = 0
    overlap_tokens: int = 0
    micro_batch_size: int = 0
    seq_len: int = 0
    world_size: int = 0
    grad_accum_steps: int = 0
    tokens_per_step: int = 0
    planned_tokens: int = 0
    allow_repeat: bool = False
    replay_sources: str = "[]"  # JSON list
    # JSON [{checkpoint, step, reason}]: the damaged checkpoints the part's segment passed over at its resume
    passed_over: str = "[]"
    mlflow_run_id: str = ""
    created_at: float = field(default_factory=time.time)

    @property
    def counts(self) -> TokenCounts:
        return TokenCounts.from_mapping(self.__dict__)

    @property
    def batch(self) -> BatchPlan:
        """The part's four tokens_per_step factors (the audit derives each rank's rows from them)."""
        return BatchPlan(self.micro_batch_size, self.seq_len, self.world_size, self.grad_accum_steps)


@dataclass(frozen=True)
class PartKeys:
    """The part of a run segment a per-part table's row belongs to."""

    part_id: str
    run_key: str
    stage: str
    segment: int


@dataclass(frozen=True)
class ConsumptionRow(Piece, PartKeys):
    """A piece the loader delivered in a part (`consumption`): the part's keys, then the Piece (shard,
    epoch, token range, tokens), then the raw rows it spans (the bases' fields come first, in the
    file's column order)."""

    row_start: int
    row_end: int

    @classmethod
    def of(cls, part: PartRow, piece: Piece, rows: tuple[int, int]) -> ConsumptionRow:
        """`piece`, read in `part`, spanning raw rows [rows[0], rows[1])."""
        keys = (part.part_id, part.run_key, part.stage, part.segment)
        return cls(*keys, piece.source, piece.shard_id, piece.split, piece.epoch, piece.tok_start, piece.tok_end, *rows)


@dataclass(frozen=True)
class ShareRow:
    """One rank's share of a part (`shares`): the global rows it read and its four figures."""

    part_id: str
    run_key: str
    rank: int
    world_size: int
    row_count: int
    row_ranges: list[list[int]] = _json()  # [[start, end), ...] of global rows, sorted
    real_tokens: int = 0
    pad_tokens: int = 0
    loss_tokens: int = 0
    cropped_tokens: int = 0

    @property
    def counts(self) -> TokenCounts:
        return TokenCounts.from_mapping(self.__dict__)


@dataclass(frozen=True)
class CheckpointFileRow:
    """Per part that committed a checkpoint, one row per file of that checkpoint (but the part's own ledger
    files and the COMPLETE marker): its sha256. Kept in the store's ledger, outside the checkpoint, so a copy
    that rewrote a checkpoint's files together with its marker is still found when it is loaded."""

    part_id: str
    run_key: str
    step: int
    file: str
    sha256: str


@dataclass(frozen=True)
class FeedRow:
    """Per part, rank and step: what the rank fed the model (ghostvis_core/digest.py), for the content proof."""

    part_id: str
    run_key: str
    rank: int
    step: int
    step_digest: str
    micro_digests: list[str] = _json()  # digest per micro-batch
    micro_rows: list[list[int]] = _json()  # [global rows] per micro-batch
    row_digests: list[list[str]] = _json()  # [digest per row] per micro-batch
    image_hashes: list[list[str]] = _json()  # [hash per image] per micro-batch


@dataclass(frozen=True)
class RolloutRow:
    """Per part, rank and step of an rl run (ghostvis_core/run/train/grpo.py): the rollout figures and
    every completion the rank sampled."""

    part_id: str
    run_key: str
    rank: int
    step: int
    generated_tokens: int
    rewarded_tokens: int  # of exact-answer completions (reward >= 1)
    completions: int
    correct_completions: int
    rows: list[int] = _json()  # global row per completion
    completion_ids: list[list[int]] = _json()  # [token id] per completion
    rewards: list[float] = _json()  # reward per completion


@dataclass(frozen=True)
class TimelineRow:
    """One interval of a launch's timeline (`timeline`; ghostvis_core/run/train/timeline.py): what rank 0 of a
    training job (side "job") or the launching side (side "launcher") spent time on. Times are seconds on the
    launch's host's monotonic clock after `origin_s` (the process start, or the launch's start on the launching
    side); two launches' clocks are compared only when their `boot_id` is the same (one kernel, one clock),
    otherwise only durations are. Kinds: startup, load, eval, save, lease_wait, steps (`step_first`..`step_last`,
    `reason` committed or uncommitted), detection, launch (the launching side's: `reason` completed, preempted,
    failed, killed), finish, end (`reason`: completed, preempted, hung, failed, lease lost)."""

    run_key: str
    stage: str
    launch_id: str  # the process's: host, pid and its start
    side: str
    segment: int
    host: str
    boot_id: str
    origin_s: float  # the host's monotonic clock at the launch's origin
    kind: str
    start_s: float  # after the origin
    duration_s: float
    step_first: int = 0
    step_last: int = 0
    reason: str = ""
    created_at: float = field(default_factory=time.time)


@dataclass(frozen=True)
class RowIndexRow:
    """Per planned global row of a run's chain (ghostvis_core/verify/audit/row_index.py): its part, where
    the row rule puts it and one span of a shard it read, as tokens and raw rows."""

    part_id: str
    run_key: str
    stage: str
    segment: int
    step: int
    rank: int
    micro_batch: int
    global_row: int
    shard_id: str
    epoch: int
    tok_start: int
    tok_end: int
    row_start: int
    row_end: int


@dataclass(frozen=True)
class DocRow:
    """Per document of a shard, its hash (text, plus image bytes): the same document in train and validation."""

    shard_id: str
    source: str
    split: str
    content_sha256: str
    row: int
    doc_hash: str


@dataclass(frozen=True)
class NgramRow:
    """Per training or validation document (raw row), one of its winnowed 13-gram fingerprints
    (ghostvis_core/data/ngrams.py), for the decontamination gate (ghostvis_core/verify/audit/contamination.py)."""

    shard_id: str
    source: str
    split: str
    content_sha256: str
    row: int
    ngram_hash: int


@dataclass(frozen=True)
class DocumentFingerprints:
    """One document (raw row) of one version of a shard, with its distinct fingerprints (`NgramRow`s
    grouped), sorted: what the decontamination gate compares, read a document at a time because it
    compares sets (`LedgerQueries.document_fingerprints`)."""

    shard_id: str
    content_sha256: str
    row: int
    ngram_hashes: list[int]


@dataclass(frozen=True)
class PassedOver:
    """A damaged checkpoint a resumed segment passed over (an entry of a part's `passed_over`): the steps
    after `step` were trained again."""

    checkpoint: str
    step: int
    reason: str


@dataclass(frozen=True)
class RunTotals:
    """Along a run's chain (segments summed): the four token figures, overlap tokens, the last step, the
    segments and the number of parts (`LedgerQueries.run_totals`)."""

    counts: TokenCounts
    overlap_tokens: int
    steps: int
    segments: tuple[int, ...]
    parts: int

    def as_dict(self) -> dict[str, Any]:
        """Flat, the four figures by their TokenCounts names first: how `ghostvis ledger` prints a run."""
        return {
            **self.counts.as_dict(),
            "overlap_tokens": self.overlap_tokens,
            "steps": self.steps,
            "segments": list(self.segments),
            "parts": self.parts,
        }


@dataclass(frozen=True)
class Segment:
    """One launch of a run along its chain (`LedgerQueries.segments`): its step range, world size and real
    tokens (the field order is `ghostvis ledger --run --json`'s)."""

    segment: int
    first_step: int
    world_size: int
    real_tokens: int
    last_step: int


@dataclass(frozen=True)
class ShardConsumption:
    """What a run's chain read of one shard (`LedgerQueries.consumed_by_shard`): tokens, the raw row span
    touched and in how many epochs; `split` is the label the trainer wrote."""

    source: str
    shard_id: str
    split: str
    tokens: int
    row_start: int
    row_end: int
    epochs: int

    @property
    def rows(self) -> str:
        """The raw row span touched, "start..end", as the checks and tables show it."""
        return f"{self.row_start}..{self.row_end}"


@dataclass(frozen=True)
class LeakedShard:
    """A shard a run's chain read that the shard table does not call train (`LedgerQueries.leakage`):
    `split` is the table's ("not in the ledger" when it has no record), `label` the trainer's."""

    consumed: ShardConsumption
    split: str

    @property
    def label(self) -> str:
        return self.consumed.split


@dataclass(frozen=True)
class SharedDocument:
    """A document holding some of the fingerprints looked up (`LedgerQueries.documents_sharing`), with how
    many distinct ones (`shared`)."""

    shard_id: str
    content_sha256: str
    split: str
    row: int
    shared: int


@dataclass(frozen=True)
class DocInBothSplits:
    """A document whose hash is in both a validation and a train shard of a source
    (`summaries.train_validation_overlap`)."""

    source: str
    doc_hash: str
    validation_shard: str
    validation_row: int
    train_shard: str
    train_row: int


@dataclass(frozen=True)
class SourceSplitTotals:
    """Per (source, split) of the shard table (`summaries.source_split_totals`): shards, docs, tokens and
    text bytes, as the tokenized_shards asset shows them."""

    source: str
    split: str
    shards: int
    docs: int
    tokens: int
    text_bytes: int


@dataclass(frozen=True)
class RunSummary:
    """A training run in the ledger (`summaries.run_summaries`): its stage, keys, plan and `RunTotals`."""

    stage: str
    run_key: str
    parent_run_key: str | None
    planned_tokens: int
    tokens_per_step: int
    totals: RunTotals

    def as_dict(self) -> dict[str, Any]:
        """Flat, the totals after the run's keys and plan: how `ghostvis ledger --json` prints a run."""
        keys = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "totals"}
        return {**keys, **self.totals.as_dict()}


@dataclass(frozen=True)
class ConsumedRange(Piece):
    """Consumption rows of a shard, split and epoch joined where they touch (`summaries.merge_ranges`):
    the joined Piece (its tokens the pieces' sum, as they touch), the raw row range, and how many pieces
    (`parts`) were joined."""

    row_start: int
    row_end: int
    parts: int

    def as_dict(self) -> dict[str, Any]:
        """As `ghostvis ledger --run --json` prints a range: the row range before the tokens and parts."""
        out = asdict(self)
        tokens, parts = out.pop("tokens"), out.pop("parts")
        return {**out, "tokens": tokens, "parts": parts}


@dataclass(frozen=True)
class RunConsumption:
    """What a run consumed along its chain, from the ledger alone (`summaries.run_consumption`, what
    `ghostvis ledger --run` prints): its keys, steps, parts, plan, the four token figures, overlap, and
    its segments, shards and ranges."""

    run_key: str
    stage: str
    parent_run_key: str | None
    steps: int
    parts: int
    planned_tokens: int
    tokens_per_step: int
    counts: TokenCounts
    overlap_tokens: int
    consumed_tokens: int  # the ranges' tokens summed
    segments: tuple[Segment, ...]
    shards: tuple[ShardConsumption, ...]
    ranges: tuple[ConsumedRange, ...]

    def as_dict(self) -> dict[str, Any]:
        """Flat, the four figures by their TokenCounts names in place of `counts`, the lists as objects:
        `ghostvis ledger --run --json`."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "counts":
                out.update(value.as_dict())
            elif f.name == "ranges":
                out[f.name] = [r.as_dict() for r in value]
            elif isinstance(value, tuple):
                out[f.name] = [asdict(v) for v in value]
            else:
                out[f.name] = value
        return out


@dataclass(frozen=True)
class DuplicateContent:
    """Shards with the same content under different names (`summaries.duplicate_shards`)."""

    content_sha256: str
    shards: tuple[str, ...]


@dataclass(frozen=True)
class SelectedNotTrain:
    """A shard selected for training whose ledger split is not train (`summaries.validation_selected`):
    `split` is the ledger's ("not in the ledger" when it has no record), `spec_split` the spec's label."""

    source: str
    shard_id: str
    split: str
    spec_split: str


def schema_of(record: type) -> pa.Schema:
    """The Parquet schema of a ledger table: its record's fields in order, a `json` field as a string."""
    hints = get_type_hints(record)
    return pa.schema(
        [(f.name, pa.string() if f.metadata.get("json") else _ARROW[hints[f.name]]) for f in fields(record)]
    )


@cache
def _given(record: type) -> tuple[tuple[str, bool], ...]:
    """A record's fields a row gives (name, whether JSON-encoded): read once per record type, not per row
    (`dataclasses.fields` per row would cost as much as reading the rows)."""
    return tuple((f.name, bool(f.metadata.get("json"))) for f in fields(record) if f.init)


def from_rows(record: type, columns: list[str], rows: list[tuple]) -> list:
    """Records from a query's rows (columns by name; a column an older file lacks reads as None; `json`
    fields decoded; a field the record derives itself, like a Piece's tokens, is not given)."""
    at = {c: i for i, c in enumerate(columns)}
    given = [(name, at.get(name), is_json) for name, is_json in _given(record)]
    return [
        record(**{name: None if i is None else json.loads(row[i]) if is_json else row[i] for name, i, is_json in given})
        for row in rows
    ]


def table_of(record: type, rows: list) -> pa.Table:
    """The Arrow table of a ledger table's rows (`record`s), in its schema (`schema_of`): how every
    record the ledger writes becomes a file; a `json` field is encoded."""
    columns = {}
    for f in fields(record):
        values = list(map(attrgetter(f.name), rows))
        columns[f.name] = list(map(json.dumps, values)) if f.metadata.get("json") else values
    return pa.table(columns, schema=schema_of(record))


SHARD_SCHEMA = schema_of(ShardRecord)
PART_SCHEMA = schema_of(PartRow)
CONSUMPTION_SCHEMA = schema_of(ConsumptionRow)
SHARE_SCHEMA = schema_of(ShareRow)
FEED_SCHEMA = schema_of(FeedRow)
ROLLOUT_SCHEMA = schema_of(RolloutRow)
ROW_INDEX_SCHEMA = schema_of(RowIndexRow)
TIMELINE_SCHEMA = schema_of(TimelineRow)
DOC_SCHEMA = schema_of(DocRow)
NGRAM_SCHEMA = schema_of(NgramRow)

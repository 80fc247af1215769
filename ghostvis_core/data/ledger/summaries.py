"""Readings of the ledger as a whole, built on its queries: per-run summaries and what a run consumed
(`ghostvis ledger`), per-source totals, and the shard checks the launch and the audit share
(duplicate contents, documents in train and validation, validation shards selected for training)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from ghostvis_core.data.ledger.query import chain_of, chain_totals, in_list
from ghostvis_core.data.ledger.records import (
    ConsumedRange,
    ConsumptionRow,
    DocInBothSplits,
    DuplicateContent,
    PartRow,
    RunConsumption,
    RunSummary,
    SelectedNotTrain,
    ShardRecord,
    SourceSplitTotals,
)
from ghostvis_core.errors import GhostvisError
from ghostvis_core.plan.stages import stage_names

if TYPE_CHECKING:
    from ghostvis_core.data.ledger import Ledger
    from ghostvis_core.data.shard_ref import ShardRef


def source_split_totals(rows: list[ShardRecord]) -> list[SourceSplitTotals]:
    """Per (source, split) of ledger shard records, sorted: shards, docs, tokens and text_bytes."""
    by: dict[tuple[str, str], list[ShardRecord]] = {}
    for r in rows:
        by.setdefault((r.source, r.split), []).append(r)
    return [
        SourceSplitTotals(
            *key,
            shards=len(rs),
            docs=sum(r.docs for r in rs),
            tokens=sum(r.tokens for r in rs),
            text_bytes=sum(r.text_bytes for r in rs),
        )
        for key, rs in sorted(by.items())
    ]


def run_summaries(ledger: Ledger) -> list[RunSummary]:
    """Per training run in the ledger (in order of its first part): stage, run_key, parent_run_key,
    planned_tokens, tokens_per_step and its `run_totals` (the four TokenCounts figures, steps, ...),
    from one query over the part rows."""
    by_run: dict[str, list[PartRow]] = {}
    for part in ledger.parts():
        by_run.setdefault(part.run_key, []).append(part)
    return [
        RunSummary(
            parts[0].stage,
            key,
            parts[0].parent_run_key or None,
            parts[0].planned_tokens,
            parts[0].tokens_per_step,
            chain_totals(chain_of(parts)),
        )
        for key, parts in by_run.items()
    ]


def run_keys(ledger: Ledger, stage: str | None = None) -> list[str]:
    """Run keys in the ledger (of `stage` if given, variants included), in order of their first part."""
    return list(dict.fromkeys(p.run_key for p in ledger.parts(stage=stage)))


def unknown_run_message(ledger: Ledger, run_key: str, stages: list[str]) -> str:
    """One line: `run_key` has no part in the ledger; the known run keys of its stage (the part before
    '-' or '@'), or else the stages and every known run key."""
    stage = run_key.split("@")[0].split("-")[0]
    if stage in stages:
        known = run_keys(ledger, stage)
        return (
            f"stage {stage} has no run {run_key!r} in the ledger; known run keys of {stage}: "
            f"{', '.join(known) or 'none (materialize the `' + stage + '` asset)'}"
        )
    known = run_keys(ledger)
    return (
        f"unknown stage or run key {run_key!r}; stages: {', '.join(stages)}; "
        f"run keys in the ledger: {', '.join(known) or 'none (no stage has trained yet)'}"
    )


def merge_ranges(rows: list[ConsumptionRow]) -> list[ConsumedRange]:
    """Consumption rows (parts' pieces) as ranges per (source, shard, split, epoch): ranges that touch
    (one ends where the next starts) are joined and `parts` counts the pieces joined; overlapping
    ones are kept apart, so a range read twice stays visible."""
    out: list[ConsumedRange] = []
    for r in sorted(rows, key=lambda r: (r.source, r.shard_id, r.split, r.epoch, r.tok_start, r.tok_end)):
        key = (r.source, r.shard_id, r.split, r.epoch)
        cur = out[-1] if out else None
        if cur is not None and (cur.source, cur.shard_id, cur.split, cur.epoch) == key and cur.tok_end == r.tok_start:
            out[-1] = replace(
                cur,
                tok_end=r.tok_end,
                parts=cur.parts + 1,
                row_start=min(cur.row_start, r.row_start),
                row_end=max(cur.row_end, r.row_end),
            )
            continue
        out.append(ConsumedRange(*key, r.tok_start, r.tok_end, r.row_start, r.row_end, parts=1))
    return out


def run_consumption(ledger: Ledger, run_key: str) -> RunConsumption:
    """What a run consumed, from the ledger alone, along its chain: segments (steps, world size, real
    tokens), parts, the four token figures (`Ledger.run_counts`), overlap, per shard (tokens, rows,
    epochs) and per range (shard, split, epoch, token range, row range, tokens).
    Raises GhostvisError when the ledger has no part of `run_key`."""
    chain = ledger.chain(run_key)
    if not chain:
        raise GhostvisError(unknown_run_message(ledger, run_key, stage_names()))
    head = chain[-1]
    ranges = merge_ranges(ledger.consumption(chain))
    return RunConsumption(
        run_key=run_key,
        stage=head.stage,
        parent_run_key=head.parent_run_key or None,
        steps=head.step_last,
        parts=len(chain),
        planned_tokens=head.planned_tokens,
        tokens_per_step=head.tokens_per_step,
        counts=ledger.run_counts(run_key),
        overlap_tokens=sum(p.overlap_tokens for p in chain),
        consumed_tokens=sum(r.tokens for r in ranges),
        segments=tuple(ledger.segments(run_key)),
        shards=tuple(ledger.consumed_by_shard(run_key)),
        ranges=tuple(ranges),
    )


def held_out_text_shards(ledger: Ledger, tokenizer_id: str, sources: list[str]) -> dict[str, list[ShardRecord]]:
    """Of `sources`, in their order, those with plain-text validation shards tokenized with
    `tokenizer_id`: source -> its shard records (by shard_id)."""
    found: dict[str, list[ShardRecord]] = {}
    for r in ledger.shards(tokenizer_id=tokenizer_id, sources=list(sources)):
        if r.split == "validation" and r.kind == "text":
            found.setdefault(r.source, []).append(r)
    return {s: found[s] for s in sources if s in found}


def duplicate_shards(ledger: Ledger, tokenizer_id: str) -> list[DuplicateContent]:
    """Shards with the same content hash under different names."""
    by_sha: dict[str, list[str]] = {}
    for r in ledger.shards(tokenizer_id=tokenizer_id):
        by_sha.setdefault(r.content_sha256, []).append(r.shard_id)
    return [DuplicateContent(sha, tuple(ids)) for sha, ids in by_sha.items() if len(ids) > 1]


def train_validation_overlap(ledger: Ledger, shards: list[ShardRecord]) -> list[DocInBothSplits]:
    """Documents whose normalised text is in both a train and a validation shard of a source
    (`shards`: the current ledger records, so older versions of a shard do not count)."""
    if not shards:
        return []
    shas = sorted({r.content_sha256 for r in shards})
    return ledger._query(
        DocInBothSplits,
        "docs",
        f"""WITH d AS (SELECT DISTINCT * FROM docs WHERE content_sha256 IN ({in_list(shas)}))
            SELECT v.source, v.doc_hash, v.shard_id AS validation_shard, v.row AS validation_row,
                   t.shard_id AS train_shard, t.row AS train_row
            FROM d v JOIN d t ON v.doc_hash = t.doc_hash AND v.source = t.source
            WHERE v.split = 'validation' AND t.split = 'train' ORDER BY v.shard_id, v.row""",
        shas,
    )


def validation_selected(
    ledger: Ledger, tokenizer_id: str, train_shards: dict[str, tuple[ShardRef, ...]]
) -> list[SelectedNotTrain]:
    """Shards selected for training (a launch spec's train_shards) whose ledger split is not train, or
    that the ledger does not know: checked before launch and again by the stage checks, because what
    is selected is what the run may read, whatever it happened to consume."""
    known = {
        (r.shard_id, r.content_sha256): r.split for r in ledger.shards(tokenizer_id=tokenizer_id, every_version=True)
    }
    out = []
    for source, refs in sorted(train_shards.items()):
        for ref in refs:
            split = known.get((ref.shard_id, ref.content_sha256), "not in the ledger")
            if split != "train":  # the ledger's split; the spec's label is shown, never trusted
                out.append(SelectedNotTrain(source, ref.shard_id, split, ref.split))
    return out

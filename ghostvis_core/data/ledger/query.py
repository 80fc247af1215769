"""The ledger's querying side: DuckDB over the Parquet files, each table's rows returned as its typed
record (records.py), plus the run-level readings built from them (chains, totals, reuse, leakage).

A query fetches from the store only the folders it reads: a per-shard table whole, a per-part table's
stage or run folders (`run_files`), so what the audit, the checks and `ghostvis ledger --run` read does
not grow with the number of other runs."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import pyarrow.parquet as pq

from ghostvis_core.counts import TokenCounts
from ghostvis_core.data.ledger.files import LedgerFiles, connection, parquet_list
from ghostvis_core.data.ledger.records import (
    NGRAM_INDEX_FILES,
    CheckpointFileRow,
    ConsumptionRow,
    DocumentFingerprints,
    FeedRow,
    LeakedShard,
    PartRow,
    PassedOver,
    RolloutRow,
    RowIndexRow,
    RunTotals,
    Segment,
    ShardConsumption,
    ShardRecord,
    SharedDocument,
    ShareRow,
    TimelineRow,
    from_rows,
)

R = TypeVar("R")

# Ledger.reuse's kinds of a range read twice that nothing declared: the `no_reuse` check fails on them.
UNDECLARED_KINDS = ("reuse", "undeclared_repeat", "undeclared_cross_stage")


@dataclass(frozen=True)
class RunHead:
    """A run's newest part file (the head of its chain), from a listing of the part folders."""

    stage: str
    run_key: str
    head: Path


@dataclass(frozen=True)
class RunLink:
    """A run and the run it started from ("" for none), from its part rows."""

    stage: str
    run_key: str
    parent_run_key: str


@dataclass(frozen=True)
class Reuse:
    """A token range of a shard read twice within a run's lineage (`Ledger.reuse`): the two parts that read
    it (part_a/b, run_a/b, their segments and steps "3..4"), the overlap as tokens and raw rows, and its
    kind; `checkpoint` and `reason` name the damaged checkpoint a retrained range was passed over for.
    The query fills what the consumption rows hold (the rest read as None); the kind and the parts'
    segments and steps are added from the part rows."""

    kind: str
    shard_id: str
    source: str
    tok_start: int
    tok_end: int
    row_start: int
    row_end: int
    tokens: int
    part_a: str
    run_a: str
    epoch_a: int
    segment_a: int
    steps_a: str
    part_b: str
    run_b: str
    epoch_b: int
    segment_b: int
    steps_b: str
    checkpoint: str
    reason: str


def in_list(values: list) -> str:
    """The placeholders of an SQL `IN (...)` over `values`: one `?` each, bound in their order."""
    return ",".join("?" * len(values))


def _with_table(table: str, source: str, sql: str) -> str:
    """`sql` with `table` defined as a common table expression over `source`, ahead of its own ones."""
    head = f"WITH {table} AS (SELECT * FROM {source})"
    return f"{head}, {sql[len('WITH ') :]}" if sql.lstrip().upper().startswith("WITH ") else f"{head} {sql}"


class LedgerQueries(LedgerFiles):
    def _query(
        self, record: type[R], table: str, sql: str, params: list | None = None, files: list[Path] | None = None
    ) -> list[R]:
        """Rows of `sql` as `record`s (`from_rows`: its fields by column name), `sql` reading `table` by its
        name: a per-shard table's every file, or a per-part table's `files` (`run_files`: files or glob
        patterns); columns by name, so a column added later reads as NULL in older files."""
        if files is None:
            self._fetched(table)
            folder = self.root / table
            if not folder.exists() or not any(folder.glob("*.parquet")):
                return []
            source = f"read_parquet('{folder}/*.parquet', union_by_name=true)"
        elif not files:
            return []
        else:  # the folders' stage=/run= are not made columns; by name, as for the per-shard tables
            source = f"read_parquet({parquet_list(files)}, hive_partitioning=false, union_by_name=true)"
        cur = connection().cursor()
        try:
            result = cur.execute(_with_table(table, source, sql), params or [])
            return from_rows(record, [d[0] for d in result.description], result.fetchall())
        finally:
            cur.close()

    def run_files(self, table: str, run_keys: list[str] | None = None, stage: str | None = None) -> list[Path]:
        """The files of a per-part table for these runs (of any stage), else the glob pattern of one
        stage's runs or of every run (none when nothing matches, which DuckDB would refuse): only the
        folders asked for are listed (and fetched from the store: the run's folder when the stage is
        given, else the table's); a pattern is expanded by DuckDB as it reads."""
        folder = self.root / table
        self._fetch_runs(table, run_keys, stage)
        if run_keys is not None:
            return sorted(
                f for key in dict.fromkeys(run_keys) for f in folder.glob(f"stage={stage or '*'}/run={key}/*.parquet")
            )
        pattern = f"stage={stage or '*'}/run=*/*.parquet"
        return [folder / pattern] if next(folder.glob(pattern), None) else []

    def _fetch_runs(self, table: str, run_keys: list[str] | None, stage: str | None) -> None:
        """From the store, only the folders of a per-part table that a query reads."""
        if stage is None:
            self._fetched(table)
        elif run_keys is None:
            self._fetched(f"{table}/stage={stage}")
        else:
            for key in dict.fromkeys(run_keys):
                self._fetched(f"{table}/stage={stage}/run={key}")

    def _of_parts(self, record: type[R], table: str, parts: list[Any], order: str) -> list[R]:
        """The rows of `table` that belong to `parts` (records carrying part_id and run_key), as `record`s,
        read from their runs' folders only."""
        if not parts:
            return []
        ids = sorted({p.part_id for p in parts})
        return self._query(
            record,
            table,
            f"SELECT * FROM {table} WHERE part_id IN ({in_list(ids)}) ORDER BY {order}",
            ids,
            self.run_files(table, [p.run_key for p in parts]),
        )

    def shards(
        self, tokenizer_id: str | None = None, sources: list[str] | None = None, every_version: bool = False
    ) -> list[ShardRecord]:
        """Newest record per (shard_id, tokenizer_id): the shard's current version. `every_version`: one
        record per content of the shard too, for what runs read from a shard's earlier versions."""
        where, params = ["1=1"], []
        if tokenizer_id:
            where.append("tokenizer_id = ?")
            params.append(tokenizer_id)
        if sources:
            where.append(f"source IN ({','.join('?' * len(sources))})")
            params.extend(sources)
        version = ", content_sha256" if every_version else ""
        rows = self._query(
            ShardRecord,
            "shards",
            f"""SELECT * EXCLUDE (rn) FROM (
                  SELECT *, row_number() OVER (PARTITION BY shard_id, tokenizer_id{version} ORDER BY created_at DESC) rn
                  FROM shards WHERE {" AND ".join(where)}) WHERE rn = 1 ORDER BY shard_id, created_at""",
            params,
        )
        return [replace(r, token_path=str(self.store_folder / r.token_path) if r.token_path else "") for r in rows]

    def parts(self, run_keys: list[str] | None = None, stage: str | None = None) -> list[PartRow]:
        """Part rows of these runs, or of a stage's runs, or of every run, oldest first."""
        return self._query(
            PartRow, "parts", "SELECT * FROM parts ORDER BY created_at", files=self.run_files("parts", run_keys, stage)
        )

    def checkpoint_files(self, run_key: str, step: int) -> dict[str, str]:
        """The sha256 of each file of the run's checkpoint of `step`, as the ledger part that committed it
        recorded them; {} when no part did (not published yet, or committed before parts recorded them)."""
        rows = self._query(
            CheckpointFileRow,
            "checkpoint_files",
            "SELECT * FROM checkpoint_files WHERE run_key = ? AND step = ? ORDER BY file",
            [run_key, step],
            files=self.run_files("checkpoint_files", [run_key]),
        )
        return {r.file: r.sha256 for r in rows}

    def consumption(self, parts: list[Any]) -> list[ConsumptionRow]:
        """The pieces the loader delivered in `parts` (part rows, or any records naming part_id and run_key)."""
        return self._of_parts(ConsumptionRow, "consumption", parts, "shard_id, tok_start")

    def shares(self, parts: list[Any]) -> list[ShareRow]:
        """Per part and rank: the rank's rows (`row_ranges`) and its four figures."""
        return self._of_parts(ShareRow, "shares", parts, "part_id, rank")

    def feeds(self, parts: list[Any]) -> list[FeedRow]:
        """Per part, rank and step: the content digests of what the rank fed the model."""
        return self._of_parts(FeedRow, "feeds", parts, "step, rank")

    def rollouts(self, parts: list[Any]) -> list[RolloutRow]:
        """Per part, rank and step of an rl run: the rollout figures and completions."""
        return self._of_parts(RolloutRow, "rollouts", parts, "step, rank")

    def document_fingerprints(self, content_sha256s: list[str]) -> list[DocumentFingerprints]:
        """Per document of these shard contents, its fingerprints (grouped in DuckDB: a document's set
        arrives as one list, not one record per fingerprint), by shard and row."""
        if not content_sha256s:
            return []
        return self._query(
            DocumentFingerprints,
            "ngrams",
            "SELECT shard_id, content_sha256, row, list(DISTINCT ngram_hash ORDER BY ngram_hash) AS ngram_hashes "
            f"FROM ngrams WHERE content_sha256 IN ({in_list(content_sha256s)}) "
            "GROUP BY shard_id, content_sha256, row ORDER BY shard_id, row, content_sha256",
            list(content_sha256s),
        )

    def ngram_files(self) -> list[Path]:
        """What holds every shard's fingerprints: the index file that holds the most ngrams/ files, and the
        ngrams/ files it does not hold (written since)."""
        self._fetched("ngrams")
        self._fetched("ngram_index")
        names = {f.name for f in (self.root / "ngrams").glob("*.parquet")}
        best, held = None, set()
        for f in (self.root / "ngram_index").glob("*.parquet"):
            files = set(json.loads(pq.read_schema(f).metadata[NGRAM_INDEX_FILES]))
            if files <= names and len(files) > len(held):
                best, held = f, files
        return ([best] if best else []) + [self.root / "ngrams" / n for n in sorted(names - held)]

    def documents_sharing(self, ngram_hashes: list[int]) -> list[SharedDocument]:
        """The documents holding any of these fingerprints, with how many they hold (`shared`), most first:
        a text found by its fingerprints (`ghostvis trace --text`)."""
        if not ngram_hashes:
            return []
        return self._query(
            SharedDocument,
            "ngrams",
            "SELECT shard_id, content_sha256, split, row, COUNT(DISTINCT ngram_hash) AS shared FROM ngrams "
            f"WHERE ngram_hash IN ({','.join('?' * len(ngram_hashes))}) "
            "GROUP BY shard_id, content_sha256, split, row ORDER BY shared DESC, shard_id, row",
            list(ngram_hashes),
            self.ngram_files(),
        )

    def run_heads(self) -> list[RunHead]:
        """Per run: stage, run_key and `head`, the local file of its newest part (the head of its chain: part
        files are named by segment and last step). A listing of the part folders; no file is read."""
        self._fetched("parts")
        out = []
        for run in sorted((self.root / "parts").glob("stage=*/run=*")):
            head = max(run.glob("*.parquet"), default=None)
            if head is not None:
                out.append(RunHead(run.parent.name.split("=", 1)[1], run.name.split("=", 1)[1], head))
        return out

    def run_links(self, heads: list[RunHead]) -> list[RunLink]:
        """stage, run_key and parent_run_key of these runs (`run_heads`): a run's parent is in every one of
        its part rows, so only its head part's file is read."""
        return self._query(
            RunLink, "parts", "SELECT DISTINCT stage, run_key, parent_run_key FROM parts", files=[h.head for h in heads]
        )

    def row_index_file(self, head: Path) -> Path:
        """Where the row index of the chain whose head part is the file `head` (`run_heads`) is (or would be)."""
        index = self.root / "row_index" / head.relative_to(self.root / "parts")
        return self._fetched_file(index.relative_to(self.root).as_posix())

    def row_index(self, files: list[Path], where: str = "1=1", params: list | None = None) -> list[RowIndexRow]:
        """The rows of these row index files that satisfy `where`, in row-rule order."""
        return self._query(
            RowIndexRow,
            "row_index",
            f"SELECT * FROM row_index WHERE {where} ORDER BY step, rank, micro_batch, global_row, epoch, tok_start",
            params,
            files,
        )

    def timeline(self, run_keys: list[str], stage: str | None = None) -> list[TimelineRow]:
        """The timeline rows of these runs' launches (both sides), by launch and time."""
        return self._query(
            TimelineRow,
            "timeline",
            "SELECT * FROM timeline ORDER BY created_at, launch_id, start_s",
            files=self.run_files("timeline", run_keys, stage),
        )

    def chain(self, run_key: str) -> list[PartRow]:
        """The parts that lead to the run's newest checkpoint, oldest first."""
        return chain_of(self.parts([run_key]))

    def run_counts(self, run_key: str) -> TokenCounts:
        """The four token figures along the run's chain (segments summed)."""
        return TokenCounts.total(p.counts for p in self.chain(run_key))

    def run_totals(self, run_key: str) -> RunTotals:
        """The four token figures, overlap_tokens, steps, segments and parts along the run's chain."""
        return chain_totals(self.chain(run_key))

    def segments(self, run_key: str) -> list[Segment]:
        """Per segment (launch) of the run, in chain order: its step range, world size and real tokens."""
        by_segment: dict[int, list[PartRow]] = {}
        for part in self.chain(run_key):
            by_segment.setdefault(part.segment, []).append(part)
        return [
            Segment(s, ps[0].step_first, ps[0].world_size, sum(p.real_tokens for p in ps), ps[-1].step_last)
            for s, ps in by_segment.items()
        ]

    def lineage(self, run_key: str) -> list[str]:
        """The run and its upstream runs (parent_run_key links), nearest first."""
        out, seen = [], set()
        cur: str | None = run_key
        while cur and cur not in seen:
            seen.add(cur)
            out.append(cur)
            parts = self.parts([cur])
            cur = parts[-1].parent_run_key if parts else None
        return out

    def consumed_by_shard(self, run_key: str) -> list[ShardConsumption]:
        """Per shard: tokens consumed along the run's chain and the row span touched."""
        ids = [p.part_id for p in self.chain(run_key)]
        if not ids:
            return []
        return self._query(
            ShardConsumption,
            "consumption",
            f"""SELECT source, shard_id, split, sum(tokens) AS tokens, min(row_start) AS row_start,
                       max(row_end) AS row_end, count(DISTINCT epoch) AS epochs
                FROM consumption WHERE part_id IN ({in_list(ids)})
                GROUP BY ALL ORDER BY shard_id""",
            ids,
            self.run_files("consumption", [run_key]),
        )

    def reuse(self, run_key: str) -> list[Reuse]:
        """Token ranges consumed twice within the run's lineage, each classified.

        kind = 'retrained_after_fallback' (same run, same epoch: a later segment resumed from an earlier
        checkpoint because the one holding the other part was damaged, and declared it in its parts'
        `passed_over`: `checkpoint` and `reason` name it), 'reuse' (the same without that declaration: e.g.
        resumed from an old checkpoint while the later part's tokens had been trained), 'repeat' (same run,
        another epoch), 'replay' (an upstream run's tokens read again, declared in replay_sources) or
        'undeclared_cross_stage'; UNDECLARED_KINDS are failures. Each row names both parts (part_a/b,
        run_a/b) with their segment (segment_a/b) and steps (steps_a/b, "3..4"), so a message can say
        which launches and steps read the range.
        """
        runs = self.lineage(run_key)
        parts = {p.part_id: p for p in self.parts(runs)}
        if not parts:
            return []
        ids = list(parts)
        overlaps = self._query(
            Reuse,
            "consumption",
            f"""WITH c AS (SELECT * FROM consumption WHERE part_id IN ({in_list(ids)})),
                o AS (SELECT a.part_id AS part_a, b.part_id AS part_b, a.run_key AS run_a, b.run_key AS run_b,
                       a.shard_id, a.source, a.epoch AS epoch_a, b.epoch AS epoch_b,
                       greatest(a.tok_start, b.tok_start) AS tok_start, least(a.tok_end, b.tok_end) AS tok_end,
                       greatest(a.row_start, b.row_start) AS row_start, least(a.row_end, b.row_end) AS row_end
                FROM c a JOIN c b ON a.shard_id = b.shard_id
                  AND (a.part_id < b.part_id OR (a.part_id = b.part_id AND a.epoch < b.epoch))
                  AND a.tok_start < b.tok_end AND b.tok_start < a.tok_end
                WHERE a.run_key = ? OR b.run_key = ?)
                SELECT *, tok_end - tok_start AS tokens FROM o ORDER BY shard_id, tok_start""",
            ids + [run_key, run_key],
            self.run_files("consumption", runs),
        )
        out = []
        for r in overlaps:
            pa_, pb = parts[r.part_a], parts[r.part_b]
            later = pa_ if pa_.created_at >= pb.created_at else pb
            fallback = None
            if r.run_a == r.run_b:
                if r.epoch_a == r.epoch_b:
                    fallback = passed_over(pa_, pb)
                    kind = "retrained_after_fallback" if fallback else "reuse"
                else:
                    kind = "repeat" if later.allow_repeat else "undeclared_repeat"
            else:
                declared = json.loads(later.replay_sources or "[]")
                kind = "replay" if r.source in declared else "undeclared_cross_stage"
            out.append(
                replace(
                    r,
                    kind=kind,
                    segment_a=pa_.segment,
                    steps_a=f"{pa_.step_first}..{pa_.step_last}",
                    segment_b=pb.segment,
                    steps_b=f"{pb.step_first}..{pb.step_last}",
                    checkpoint=fallback.checkpoint if fallback else "",
                    reason=fallback.reason if fallback else "",
                )
            )
        return out

    def shard_splits(self, tokenizer_id: str | None = None) -> dict[str, str]:
        """shard_id -> its split in the shard table (the newest record per shard, of `tokenizer_id` when
        given): the one authority on splits, since a label a trainer wrote can be wrong."""
        return {r.shard_id: r.split for r in sorted(self.shards(tokenizer_id=tokenizer_id), key=lambda r: r.created_at)}

    def leakage(
        self, run_key: str, tokenizer_id: str | None = None, versions: dict[str, str] | None = None
    ) -> list[LeakedShard]:
        """Shards consumed along the run's chain that the shard table does not call train, or does not
        know (`split` is the table's, `label` what the trainer wrote into the consumption rows): a
        validation shard merged into a train stream under a `train` label is found all the same.
        `tokenizer_id` is the run's (its launch spec's); None takes each shard's newest record.
        `versions` (shard_id -> content sha256, the run's `shard_versions`): a shard is judged by the record
        of the version the run read, not by a newer version's, whose split may differ."""
        splits = self.shard_splits(tokenizer_id)
        if versions:
            recorded = {
                (r.shard_id, r.content_sha256): r.split
                for r in self.shards(tokenizer_id=tokenizer_id, every_version=True)
            }
            splits |= {s: recorded.get((s, sha), "not in the ledger") for s, sha in versions.items()}
        consumed = self.consumed_by_shard(run_key)
        leaked = [LeakedShard(r, splits.get(r.shard_id, "not in the ledger")) for r in consumed]
        return [r for r in leaked if r.split != "train"]


def passed_over(a: PartRow, b: PartRow) -> PassedOver | None:
    """Of two parts of one run that read the same range in one epoch: the damaged checkpoint the later
    segment declared it passed over (its `passed_over` entry) when that checkpoint is the one that held
    the earlier segment's part, so the later segment trained those steps again; else None."""
    earlier, later = sorted((a, b), key=lambda p: p.segment)
    if earlier.segment == later.segment:
        return None
    declared = [PassedOver(**d) for d in json.loads(later.passed_over or "[]")]
    return next((d for d in declared if d.step == earlier.step_last), None)


def chain_of(parts: list[PartRow]) -> list[PartRow]:
    """Of one run's part rows, those that lead to its newest checkpoint (prev_part_id links), oldest first."""
    if not parts:
        return []
    by_id = {p.part_id: p for p in parts}
    head = max(parts, key=lambda p: (p.segment, p.step_last, p.created_at))
    out = []
    cur: PartRow | None = head
    while cur is not None:
        out.append(cur)
        cur = by_id.get(cur.prev_part_id or "")
    return out[::-1]


def chain_totals(chain: list[PartRow]) -> RunTotals:
    """The four token figures, overlap_tokens, steps, segments and parts of a chain."""
    return RunTotals(
        counts=TokenCounts.total(p.counts for p in chain),
        overlap_tokens=sum(p.overlap_tokens for p in chain),
        steps=chain[-1].step_last if chain else 0,
        segments=tuple(sorted({p.segment for p in chain})),
        parts=len(chain),
    )

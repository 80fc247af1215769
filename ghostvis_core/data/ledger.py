"""The token ledger: append-only Parquet files, queried through DuckDB.

Tables in the artifact store's "ledger" artifact (`Ledger.in_store(store)`):
- shards/       one file per tokenized shard: what each shard holds (docs, tokens, bytes, drops).
- parts/        one file per checkpointed part of a training run segment: real/pad/loss/cropped
                tokens and the four tokens_per_step factors; `prev_part_id` chains the parts that
                lead to a checkpoint, so a run's totals are the sum along its chain; `passed_over`
                names the damaged checkpoints the part's segment resumed past (the steps it trained again).
- consumption/  per part, the (shard, epoch, token range, row range) pieces the loader delivered.
- shares/       per part and rank, that rank's share: the global rows it read and its four figures,
                so a rank whose rows or counts were dropped is visible (the part row is their sum).
- ngrams/       one file per tokenized shard: each document's winnowed 13-gram fingerprints, compared
                with the evaluation sets by the decontamination gate (ghostvis_core/verify/audit/contamination.py).
- feeds/        per part, rank and step: content digests of every micro-batch the rank fed the model
                (ghostvis_core/digest.py), which the audit recomputes from the token files.
- rollouts/     per part, rank and step of an rl run: the generated and rewarded tokens, and every
                completion the rank sampled (its global row, token ids, reward), from which the audit
                recounts the generated tokens and rebuilds the rows it fed.
- ngram_index/  every shard's fingerprints in one file sorted by hash (row groups of NGRAM_INDEX_ROWS), named
                by the ngrams/ files it holds (listed in its metadata): written by the token_ledger asset,
                read by `ghostvis trace --text` with the ngrams/ files written since.
- row_index/    per run, one file named as the head part of the chain it indexes: every planned global row
                of the chain, its part, segment, step, rank, micro-batch and the shard spans it read (tokens
                and raw rows), rebuilt by the audit (ghostvis_core/verify/audit/row_index.py) and sorted by
                shard: what `ghostvis trace` reads, one file per run, instead of the token files.
- dedup/        one file per cross-shard MinHash index of a source (ghostvis_core/data/dedup.py): each
                removed (shard, row), the (shard, row) it duplicates and the reason; written by dedup.py.

Many writers (tokenizer workers, training runs) each write their own file, atomically; nobody
rewrites a file. A file name is derived from its content key, so writing twice is harmless. The
ledger reads and writes through the artifact store (artifact kind "ledger_file"): `root` is this
node's copy, each written file is published at once, and a query fetches only the folders it reads.

The per-shard tables (shards, docs, ngrams) are flat folders. The per-part tables (parts and the four
beside it, PART_TABLES, and row_index) keep a folder per run, hive-style: `<table>/stage=<stage>/run=<run_key>/
s<segment>.p<step_last>.parquet`, so a query about some runs opens only their files, and one about a
stage only that stage's: what the audit, the checks and `ghostvis ledger --run` read does not grow
with the number of other runs. A process queries through one DuckDB connection (`_connection`).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from ghostvis_core.counts import TokenCounts
from ghostvis_core.errors import GhostvisError
from ghostvis_core.plan.stages import stage_names
from ghostvis_core.store import Store
from ghostvis_core.store.files import atomic_write, sha256_file

if TYPE_CHECKING:  # the ledger stores pieces; it does not read streams (the audit imports it)
    import duckdb

    from ghostvis_core.data.shard_ref import ShardRef
    from ghostvis_core.data.stream import Piece

# The tables written per part of a run, each in a folder per run (`Ledger.part_file`).
PART_TABLES = ("parts", "consumption", "shares", "feeds", "rollouts")

SHARD_SCHEMA = pa.schema(
    [
        ("shard_id", pa.string()),
        ("source", pa.string()),
        ("split", pa.string()),
        ("kind", pa.string()),
        ("content_sha256", pa.string()),
        ("replaces_sha256", pa.string()),  # the shard's content before this version ("": its first version)
        ("raw_bytes", pa.int64()),
        ("tokenizer_id", pa.string()),
        ("docs", pa.int64()),
        ("tokens", pa.int64()),
        ("text_bytes", pa.int64()),
        ("docs_dropped", pa.int64()),
        ("tokens_dropped", pa.int64()),
        ("drop_reasons", pa.string()),  # JSON {reason: {"docs": n, "tokens": n}}
        ("token_path", pa.string()),
        ("token_sha256", pa.string()),  # of the token file as written: a replaced file shows
        ("created_at", pa.float64()),
    ]
)

PART_SCHEMA = pa.schema(
    [
        ("part_id", pa.string()),
        ("prev_part_id", pa.string()),
        ("run_key", pa.string()),
        ("parent_run_key", pa.string()),
        ("stage", pa.string()),
        ("segment", pa.int64()),
        ("step_first", pa.int64()),
        ("step_last", pa.int64()),
        ("rows_first", pa.int64()),
        ("rows_last", pa.int64()),
        *[(name, pa.int64()) for name in TokenCounts.names()],
        ("overlap_tokens", pa.int64()),
        ("micro_batch_size", pa.int64()),
        ("seq_len", pa.int64()),
        ("world_size", pa.int64()),
        ("grad_accum_steps", pa.int64()),
        ("tokens_per_step", pa.int64()),
        ("planned_tokens", pa.int64()),
        ("allow_repeat", pa.bool_()),
        ("replay_sources", pa.string()),  # JSON list
        # JSON [{checkpoint, step, reason}]: the damaged checkpoints the part's segment passed over at its resume
        ("passed_over", pa.string()),
        ("mlflow_run_id", pa.string()),
        ("created_at", pa.float64()),
    ]
)

DOC_SCHEMA = pa.schema(
    [
        ("shard_id", pa.string()),
        ("source", pa.string()),
        ("split", pa.string()),
        ("content_sha256", pa.string()),
        ("row", pa.int64()),
        ("doc_hash", pa.string()),
    ]
)

# Per training or validation document (raw row): its winnowed 13-gram fingerprints (ghostvis_core/data/ngrams.py),
# one row per fingerprint, for the decontamination gate (ghostvis_core/verify/audit/contamination.py).
NGRAM_SCHEMA = pa.schema(
    [
        ("shard_id", pa.string()),
        ("source", pa.string()),
        ("split", pa.string()),
        ("content_sha256", pa.string()),
        ("row", pa.int64()),
        ("ngram_hash", pa.int64()),
    ]
)

NGRAM_INDEX_ROWS = 65_536  # rows per row group of the fingerprint index: a lookup reads the groups its hashes fall in
NGRAM_INDEX_FILES = b"ghostvis.ngram_files"  # the index file's metadata: the ngrams/ file names it holds (JSON)

CONSUMPTION_SCHEMA = pa.schema(
    [
        ("part_id", pa.string()),
        ("run_key", pa.string()),
        ("stage", pa.string()),
        ("segment", pa.int64()),
        ("source", pa.string()),
        ("shard_id", pa.string()),
        ("split", pa.string()),
        ("epoch", pa.int64()),
        ("tok_start", pa.int64()),
        ("tok_end", pa.int64()),
        ("tokens", pa.int64()),
        ("row_start", pa.int64()),
        ("row_end", pa.int64()),
    ]
)


SHARE_SCHEMA = pa.schema(
    [
        ("part_id", pa.string()),
        ("run_key", pa.string()),
        ("rank", pa.int64()),
        ("world_size", pa.int64()),
        ("row_count", pa.int64()),
        ("row_ranges", pa.string()),  # JSON [[start, end), ...] of global rows, sorted
        *[(name, pa.int64()) for name in TokenCounts.names()],
    ]
)

# Per part, rank and step: what the rank fed the model (ghostvis_core/digest.py), for the content proof.
FEED_SCHEMA = pa.schema(
    [
        ("part_id", pa.string()),
        ("run_key", pa.string()),
        ("rank", pa.int64()),
        ("step", pa.int64()),
        ("step_digest", pa.string()),
        ("micro_digests", pa.string()),  # JSON [digest per micro-batch]
        ("micro_rows", pa.string()),  # JSON [[global rows] per micro-batch]
        ("row_digests", pa.string()),  # JSON [[digest per row] per micro-batch]
        ("image_hashes", pa.string()),  # JSON [[hash per image] per micro-batch]
    ]
)

# Per planned global row of a run's chain (ghostvis_core/verify/audit/row_index.py): its part, where the row
# rule puts it and a span of a shard it read, as tokens and raw rows; one row per span, sorted by shard, so
# a query for a document reads only the row groups that can hold it.
ROW_INDEX_SCHEMA = pa.schema(
    [
        ("part_id", pa.string()),
        ("run_key", pa.string()),
        ("stage", pa.string()),
        ("segment", pa.int64()),
        ("step", pa.int64()),
        ("rank", pa.int64()),
        ("micro_batch", pa.int64()),
        ("global_row", pa.int64()),
        ("shard_id", pa.string()),
        ("epoch", pa.int64()),
        ("tok_start", pa.int64()),
        ("tok_end", pa.int64()),
        ("row_start", pa.int64()),
        ("row_end", pa.int64()),
    ]
)

# Per part, rank and step of an rl run (ghostvis_core/run/train/grpo.py): the rollout figures and the completions.
ROLLOUT_SCHEMA = pa.schema(
    [
        ("part_id", pa.string()),
        ("run_key", pa.string()),
        ("rank", pa.int64()),
        ("step", pa.int64()),
        ("generated_tokens", pa.int64()),
        ("rewarded_tokens", pa.int64()),  # of exact-answer completions (reward >= 1)
        ("completions", pa.int64()),
        ("correct_completions", pa.int64()),
        ("rows", pa.string()),  # JSON [global row per completion]
        ("completion_ids", pa.string()),  # JSON [[token id] per completion]
        ("rewards", pa.string()),  # JSON [reward per completion]
    ]
)


def row_ranges(rows: list[int]) -> list[list[int]]:
    """Global rows as sorted [start, end) ranges; a row read twice appears in two ranges."""
    out: list[list[int]] = []
    for r in sorted(rows):
        if out and out[-1][1] == r:
            out[-1][1] = r + 1
        else:
            out.append([r, r + 1])
    return out


def write_parquet(
    path: Path, rows: list[dict[str, Any]] | pa.Table, schema: pa.Schema, row_group_size: int | None = None
) -> Path:
    """One ledger file, written whole or not at all (readers never see half a Parquet file)."""
    table = rows if isinstance(rows, pa.Table) else pa.Table.from_pylist(rows, schema=schema)
    out = pa.BufferOutputStream()
    pq.write_table(table, out, row_group_size=row_group_size)
    return atomic_write(path, out.getvalue().to_pybytes())


def _key(*parts: Any) -> str:
    return hashlib.sha1("|".join(map(str, parts)).encode()).hexdigest()[:20]


def _shard_record_name(shard_id: str, tokenizer_id: str, content_sha256: str) -> str:
    """A shard record's file inside the ledger: one per (shard, tokenizer, content)."""
    return f"shards/{_key(shard_id, tokenizer_id, content_sha256)}.parquet"


def _ngram_name(shard_id: str, content_sha256: str) -> str:
    """A shard's n-gram fingerprints' file inside the ledger: one per (shard, content)."""
    return f"ngrams/{_key(shard_id, content_sha256)}.parquet"


_process_connection: tuple[int, duckdb.DuckDBPyConnection] | None = None
_connection_lock = threading.Lock()


def _connection() -> duckdb.DuckDBPyConnection:
    """This process's DuckDB connection (in memory: the tables are the Parquet files), opened once,
    since opening one costs more than a small query. Queries run on cursors of it, which threads may
    use at once; a forked child (a tokenizer worker) opens its own rather than share its parent's."""
    import duckdb  # here, not at the top: a training rank needs no query before its first step

    global _process_connection
    with _connection_lock:
        if _process_connection is None or _process_connection[0] != os.getpid():
            _process_connection = (os.getpid(), duckdb.connect())
        return _process_connection[1]


def _parquet_list(files: list[Path]) -> str:
    """A SQL list literal of file paths, for read_parquet."""
    return "[" + ", ".join("'" + str(f).replace("'", "''") + "'" for f in files) + "]"


def _with_table(table: str, source: str, sql: str) -> str:
    """`sql` with `table` defined as a common table expression over `source`, ahead of its own ones."""
    head = f"WITH {table} AS (SELECT * FROM {source})"
    return f"{head}, {sql[len('WITH ') :]}" if sql.lstrip().upper().startswith("WITH ") else f"{head} {sql}"


@dataclass
class Ledger:
    root: Path  # this node's folder of the ledger's Parquet tables (DuckDB reads local files)
    # where the files live for every node: written files are published to it, and a query first fetches
    # the folders it reads (only those: one table, or one stage's or run's folder). None: `root` is all.
    store: Store | None = None

    @classmethod
    def in_store(cls, store: Store) -> Ledger:
        """The ledger of an artifact store (artifact kind "ledger"); nothing is fetched until a query needs it."""
        return cls(store.writable("ledger"), store)

    # ---- writing ----
    def shard_record_path(self, shard_id: str, tokenizer_id: str, content_sha256: str) -> Path:
        """The local file of a shard's record, fetched from the store when it is there."""
        return self._fetched_file(_shard_record_name(shard_id, tokenizer_id, content_sha256))

    @property
    def store_folder(self) -> Path:
        """The local folder the ledger sits in (token paths are kept relative to it)."""
        return self.root.parent

    def _fetched(self, folder: str) -> None:
        """Bring a folder of the ledger (a table, or one stage's or run's folder of a per-part table) from
        the store to this node's copy, when the store has it."""
        if self.store is not None and self.store.exists("ledger_file", folder):
            self.store.fetch("ledger_file", folder)

    def _fetched_file(self, name: str) -> Path:
        """The local copy of one ledger file (fetched when the store has it; may not exist)."""
        self._fetched(name)
        return self.root / name

    def _write(
        self, path: Path, rows: list[dict[str, Any]] | pa.Table, schema: pa.Schema, row_group_size: int | None = None
    ) -> Path:
        """Write one file of the ledger and publish it to the store, so every node sees it."""
        write_parquet(path, rows, schema, row_group_size)
        if self.store is not None:
            self.store.publish("ledger_file", path.relative_to(self.root).as_posix())
        return path

    def write_shard(self, record: dict[str, Any]) -> Path:
        """Token paths are kept relative to the store, so a GHOSTVIS_HOME can be moved or copied; the
        token file's sha256 is kept, so a file replaced later (same rows, other tokens) is found."""
        record = {
            "created_at": time.time(),
            "replaces_sha256": "",
            "docs_dropped": 0,
            "tokens_dropped": 0,
            "drop_reasons": "{}",
            **record,
        }
        path = Path(record.get("token_path") or "")
        if path.is_file():
            record["token_sha256"] = sha256_file(path)
        if path.is_absolute() and path.is_relative_to(self.store_folder):
            record["token_path"] = str(path.relative_to(self.store_folder))
        name = _shard_record_name(record["shard_id"], record["tokenizer_id"], record["content_sha256"])
        return self._write(self.root / name, [record], SHARD_SCHEMA)

    def write_doc_hashes(
        self, shard_id: str, source: str, split: str, content_sha256: str, rows: list[int], hashes: list[str]
    ) -> Path:
        """Per document, its hash (text, plus image bytes): finds the same document in train and validation."""
        n = len(rows)
        table = pa.table(
            {
                "shard_id": [shard_id] * n,
                "source": [source] * n,
                "split": [split] * n,
                "content_sha256": [content_sha256] * n,
                "row": rows,
                "doc_hash": hashes,
            },
            schema=DOC_SCHEMA,
        )
        return self._write(self.root / "docs" / f"{_key(shard_id, content_sha256)}.parquet", table, DOC_SCHEMA)

    def ngram_record_path(self, shard_id: str, content_sha256: str) -> Path:
        """The local file of a shard's n-gram fingerprints, fetched from the store when it is there."""
        return self._fetched_file(_ngram_name(shard_id, content_sha256))

    def write_ngrams(
        self, shard_id: str, source: str, split: str, content_sha256: str, rows: list[int], hashes: list[int]
    ) -> Path:
        """Per document (raw row, repeated per fingerprint), its winnowed 13-gram hashes: what the
        decontamination gate compares with the evaluation sets. Keyed like the doc hashes (text only)."""
        n = len(rows)
        table = pa.table(
            {
                "shard_id": [shard_id] * n,
                "source": [source] * n,
                "split": [split] * n,
                "content_sha256": [content_sha256] * n,
                "row": pa.array(rows, pa.int64()),
                "ngram_hash": pa.array(hashes, pa.int64()),
            },
            schema=NGRAM_SCHEMA,
        )
        return self._write(self.root / _ngram_name(shard_id, content_sha256), table, NGRAM_SCHEMA)

    def write_ngram_index(self) -> Path | None:
        """Every ngrams/ file's fingerprints in one file sorted by hash, so a text is looked up in the few
        row groups its hashes fall in, not in a file per shard (at 10,000 shards opening each costs 20 s).
        Named by the files it holds; written again only when a shard's fingerprints were added."""
        self._fetched("ngrams")
        names = sorted(f.name for f in (self.root / "ngrams").glob("*.parquet"))
        if not names:
            return None
        name = f"ngram_index/{_key(*names)}.parquet"
        if self._fetched_file(name).is_file():
            return self.root / name
        cur = _connection().cursor()
        try:
            table = cur.sql(
                f"SELECT * FROM read_parquet({_parquet_list([self.root / 'ngrams' / n for n in names])}) "
                "ORDER BY ngram_hash, shard_id, row"
            ).to_arrow_table()
        finally:
            cur.close()
        table = table.cast(NGRAM_SCHEMA).replace_schema_metadata({NGRAM_INDEX_FILES: json.dumps(names)})
        return self._write(self.root / name, table, NGRAM_SCHEMA, NGRAM_INDEX_ROWS)

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

    def part_file(self, table: str, part: dict[str, Any]) -> Path:
        """Where `table` (one of PART_TABLES) keeps `part`'s rows: the run's folder, one file per part."""
        return (
            self.root
            / table
            / f"stage={part['stage']}"
            / f"run={part['run_key']}"
            / f"s{part['segment']:03d}.p{part['step_last']:09d}.parquet"
        )

    def write_part(
        self,
        part: dict[str, Any],
        pieces: list[dict[str, Any]],
        shares: list[dict[str, Any]] | None = None,
        feeds: list[dict[str, Any]] | None = None,
        rollouts: list[dict[str, Any]] | None = None,
    ) -> None:
        """Consumption, per-rank shares, content digests (when given: the trainer always gives them) and
        an rl run's rollouts first, then the part row: a part row is only visible once what it sums is.
        A fixed number of files in the run's folders, whatever the ledger already holds."""
        part = {"created_at": time.time(), **part}
        for k in ("stage", "run_key"):
            if not part[k] or any(c in part[k] for c in "/\\=*?["):
                raise GhostvisError(
                    f"ledger part {part['part_id']}: {k} {part[k]!r} cannot name a folder of the "
                    "ledger (empty, or holds one of / \\ = * ? [); give the run another key"
                )
        ids = {"part_id": part["part_id"], "run_key": part["run_key"]}
        rows = [{**ids, "stage": part["stage"], "segment": part["segment"], **p} for p in pieces]
        self._write(self.part_file("consumption", part), rows, CONSUMPTION_SCHEMA)
        for table, given, schema in (
            ("shares", shares, SHARE_SCHEMA),
            ("feeds", feeds, FEED_SCHEMA),
            ("rollouts", rollouts, ROLLOUT_SCHEMA),
        ):
            if given is not None:
                self._write(self.part_file(table, part), [{**ids, **r} for r in given], schema)
        self._write(self.part_file("parts", part), [part], PART_SCHEMA)

    def write_row_index(self, chain: list[dict[str, Any]], rows: list[dict[str, Any]]) -> Path:
        """The audit's row index of a run's chain (ROW_INDEX_SCHEMA rows, each naming its part and segment):
        one file, named as the chain's head part, sorted by shard and tokens."""
        ids = {"run_key": chain[-1]["run_key"], "stage": chain[-1]["stage"]}
        rows = sorted(({**ids, **r} for r in rows), key=lambda r: (r["shard_id"], r["tok_start"], r["global_row"]))
        return self._write(self.part_file("row_index", chain[-1]), rows, ROW_INDEX_SCHEMA)

    # ---- reading ----
    def _query(
        self, table: str, sql: str, params: list | None = None, files: list[Path] | None = None
    ) -> list[dict[str, Any]]:
        """Rows of `sql`, which reads `table` by its name: a per-shard table's every file, or a per-part
        table's `files` (`run_files`: files or glob patterns); columns by name, so a column added later
        reads as NULL in older files."""
        if files is None:
            self._fetched(table)
            folder = self.root / table
            if not folder.exists() or not any(folder.glob("*.parquet")):
                return []
            source = f"read_parquet('{folder}/*.parquet', union_by_name=true)"
        elif not files:
            return []
        else:  # the folders' stage=/run= are not made columns; by name, as for the per-shard tables
            source = f"read_parquet({_parquet_list(files)}, hive_partitioning=false, union_by_name=true)"
        cur = _connection().cursor()
        try:
            result = cur.execute(_with_table(table, source, sql), params or [])
            cols = [d[0] for d in result.description]
            return [dict(zip(cols, r)) for r in result.fetchall()]
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

    def _of_parts(self, table: str, parts: list[dict[str, Any]], order: str) -> list[dict[str, Any]]:
        """The rows of `table` that belong to `parts` (rows carrying part_id and run_key), read from their
        runs' folders only."""
        if not parts:
            return []
        ids = sorted({p["part_id"] for p in parts})
        marks = ",".join("?" * len(ids))
        return self._query(
            table,
            f"SELECT * FROM {table} WHERE part_id IN ({marks}) ORDER BY {order}",
            ids,
            self.run_files(table, [p["run_key"] for p in parts]),
        )

    def shards(
        self, tokenizer_id: str | None = None, sources: list[str] | None = None, every_version: bool = False
    ) -> list[dict[str, Any]]:
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
            "shards",
            f"""SELECT * EXCLUDE (rn) FROM (
                  SELECT *, row_number() OVER (PARTITION BY shard_id, tokenizer_id{version} ORDER BY created_at DESC) rn
                  FROM shards WHERE {" AND ".join(where)}) WHERE rn = 1 ORDER BY shard_id, created_at""",
            params,
        )
        for r in rows:
            r["token_path"] = str(self.store_folder / r["token_path"]) if r["token_path"] else ""
        return rows

    def parts(self, run_keys: list[str] | None = None, stage: str | None = None) -> list[dict[str, Any]]:
        """Part rows of these runs, or of a stage's runs, or of every run, oldest first."""
        return self._query(
            "parts", "SELECT * FROM parts ORDER BY created_at", files=self.run_files("parts", run_keys, stage)
        )

    def consumption(self, parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The pieces the loader delivered in `parts` (part rows, or any rows naming part_id and run_key)."""
        return self._of_parts("consumption", parts, "shard_id, tok_start")

    def shares(self, parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Per part and rank: the rank's rows (`row_ranges`, decoded) and its four figures."""
        rows = self._of_parts("shares", parts, "part_id, rank")
        for r in rows:
            r["row_ranges"] = json.loads(r["row_ranges"])
        return rows

    def feeds(self, parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Per part, rank and step: the content digests of what the rank fed the model (JSON decoded)."""
        rows = self._of_parts("feeds", parts, "step, rank")
        for r in rows:
            for k in ("micro_digests", "micro_rows", "row_digests", "image_hashes"):
                r[k] = json.loads(r[k])
        return rows

    def rollouts(self, parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Per part, rank and step of an rl run: the rollout figures and completions (JSON decoded)."""
        rows = self._of_parts("rollouts", parts, "step, rank")
        for r in rows:
            for k in ("rows", "completion_ids", "rewards"):
                r[k] = json.loads(r[k])
        return rows

    def ngrams(self, content_sha256s: list[str]) -> list[dict[str, Any]]:
        """The fingerprint rows (shard_id, split, content_sha256, row, ngram_hash) of these shard contents."""
        if not content_sha256s:
            return []
        return self._query(
            "ngrams",
            f"SELECT DISTINCT shard_id, split, content_sha256, row, ngram_hash FROM ngrams "
            f"WHERE content_sha256 IN ({','.join('?' * len(content_sha256s))}) "
            "ORDER BY shard_id, row",
            list(content_sha256s),
        )

    def documents_sharing(self, ngram_hashes: list[int]) -> list[dict[str, Any]]:
        """The documents (shard_id, content_sha256, split, row) holding any of these fingerprints, with how
        many they hold (`shared`), most first: a text found by its fingerprints (`ghostvis trace --text`)."""
        if not ngram_hashes:
            return []
        return self._query(
            "ngrams",
            "SELECT shard_id, content_sha256, split, row, COUNT(DISTINCT ngram_hash) AS shared FROM ngrams "
            f"WHERE ngram_hash IN ({','.join('?' * len(ngram_hashes))}) "
            "GROUP BY shard_id, content_sha256, split, row ORDER BY shared DESC, shard_id, row",
            list(ngram_hashes),
            self.ngram_files(),
        )

    def run_heads(self) -> list[dict[str, Any]]:
        """Per run: stage, run_key and `head`, the local file of its newest part (the head of its chain: part
        files are named by segment and last step). A listing of the part folders; no file is read."""
        self._fetched("parts")
        out = []
        for run in sorted((self.root / "parts").glob("stage=*/run=*")):
            head = max(run.glob("*.parquet"), default=None)
            if head is not None:
                out.append(
                    {"stage": run.parent.name.split("=", 1)[1], "run_key": run.name.split("=", 1)[1], "head": head}
                )
        return out

    def run_links(self, heads: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """stage, run_key and parent_run_key of these runs (`run_heads`): a run's parent is in every one of
        its part rows, so only its head part's file is read."""
        files = [h["head"] for h in heads]
        return self._query("parts", "SELECT DISTINCT stage, run_key, parent_run_key FROM parts", files=files)

    def row_index_file(self, head: Path) -> Path:
        """Where the row index of the chain whose head part is the file `head` (`run_heads`) is (or would be)."""
        index = self.root / "row_index" / head.relative_to(self.root / "parts")
        return self._fetched_file(index.relative_to(self.root).as_posix())

    def row_index(self, files: list[Path], where: str = "1=1", params: list | None = None) -> list[dict[str, Any]]:
        """The rows of these row index files that satisfy `where`, in row-rule order."""
        return self._query(
            "row_index",
            f"SELECT * FROM row_index WHERE {where} ORDER BY step, rank, micro_batch, global_row, epoch, tok_start",
            params,
            files,
        )

    def chain(self, run_key: str) -> list[dict[str, Any]]:
        """The parts that lead to the run's newest checkpoint, oldest first."""
        return chain_of(self.parts([run_key]))

    def run_counts(self, run_key: str) -> TokenCounts:
        """The four token figures along the run's chain (segments summed)."""
        return TokenCounts.total(TokenCounts.from_mapping(p) for p in self.chain(run_key))

    def run_totals(self, run_key: str) -> dict[str, Any]:
        """The four token figures (TokenCounts names), overlap_tokens, steps, segments and parts along
        the run's chain (segments summed)."""
        return chain_totals(self.chain(run_key))

    def segments(self, run_key: str) -> list[dict[str, Any]]:
        """Per segment (launch) of the run: its step range, world size and real tokens."""
        segs: dict[int, dict[str, Any]] = {}
        for part in self.chain(run_key):
            seg = segs.setdefault(
                part["segment"],
                {
                    "segment": part["segment"],
                    "first_step": part["step_first"],
                    "world_size": part["world_size"],
                    "real_tokens": 0,
                },
            )
            seg["last_step"] = part["step_last"]
            seg["real_tokens"] += part["real_tokens"]
        return list(segs.values())

    def lineage(self, run_key: str) -> list[str]:
        """The run and its upstream runs (parent_run_key links), nearest first."""
        out, seen = [], set()
        cur: str | None = run_key
        while cur and cur not in seen:
            seen.add(cur)
            out.append(cur)
            parts = self.parts([cur])
            cur = parts[-1]["parent_run_key"] if parts else None
        return out

    def consumed_by_shard(self, run_key: str) -> list[dict[str, Any]]:
        """Per shard: tokens consumed along the run's chain and the row span touched."""
        ids = [p["part_id"] for p in self.chain(run_key)]
        if not ids:
            return []
        return self._query(
            "consumption",
            f"""SELECT source, shard_id, split, sum(tokens) AS tokens, min(row_start) AS row_start,
                       max(row_end) AS row_end, count(DISTINCT epoch) AS epochs
                FROM consumption WHERE part_id IN ({",".join("?" * len(ids))})
                GROUP BY ALL ORDER BY shard_id""",
            ids,
            self.run_files("consumption", [run_key]),
        )

    def reuse(self, run_key: str) -> list[dict[str, Any]]:
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
        parts = {p["part_id"]: p for p in self.parts(runs)}
        if not parts:
            return []
        ids = list(parts)
        rows = self._query(
            "consumption",
            f"""WITH c AS (SELECT * FROM consumption WHERE part_id IN ({",".join("?" * len(ids))}))
                SELECT a.part_id AS part_a, b.part_id AS part_b, a.run_key AS run_a, b.run_key AS run_b,
                       a.shard_id, a.source, a.epoch AS epoch_a, b.epoch AS epoch_b,
                       greatest(a.tok_start, b.tok_start) AS tok_start, least(a.tok_end, b.tok_end) AS tok_end,
                       greatest(a.row_start, b.row_start) AS row_start, least(a.row_end, b.row_end) AS row_end
                FROM c a JOIN c b ON a.shard_id = b.shard_id
                  AND (a.part_id < b.part_id OR (a.part_id = b.part_id AND a.epoch < b.epoch))
                  AND a.tok_start < b.tok_end AND b.tok_start < a.tok_end
                WHERE a.run_key = ? OR b.run_key = ?
                ORDER BY a.shard_id, tok_start""",
            ids + [run_key, run_key],
            self.run_files("consumption", runs),
        )
        out = []
        for r in rows:
            pa_, pb = parts[r["part_a"]], parts[r["part_b"]]
            later = pa_ if pa_["created_at"] >= pb["created_at"] else pb
            fallback = None
            if r["run_a"] == r["run_b"]:
                if r["epoch_a"] == r["epoch_b"]:
                    fallback = passed_over(pa_, pb)
                    kind = "retrained_after_fallback" if fallback else "reuse"
                else:
                    kind = "repeat" if later["allow_repeat"] else "undeclared_repeat"
            else:
                declared = json.loads(later["replay_sources"] or "[]")
                kind = "replay" if r["source"] in declared else "undeclared_cross_stage"
            out.append(
                {
                    **r,
                    "tokens": r["tok_end"] - r["tok_start"],
                    "kind": kind,
                    "segment_a": pa_["segment"],
                    "steps_a": f"{pa_['step_first']}..{pa_['step_last']}",
                    "segment_b": pb["segment"],
                    "steps_b": f"{pb['step_first']}..{pb['step_last']}",
                    "checkpoint": fallback["checkpoint"] if fallback else "",
                    "reason": fallback["reason"] if fallback else "",
                }
            )
        return out

    def shard_splits(self, tokenizer_id: str | None = None) -> dict[str, str]:
        """shard_id -> its split in the shard table (the newest record per shard, of `tokenizer_id` when
        given): the one authority on splits, since a label a trainer wrote can be wrong."""
        return {
            r["shard_id"]: r["split"]
            for r in sorted(self.shards(tokenizer_id=tokenizer_id), key=lambda r: r["created_at"])
        }

    def leakage(
        self, run_key: str, tokenizer_id: str | None = None, versions: dict[str, str] | None = None
    ) -> list[dict[str, Any]]:
        """Shards consumed along the run's chain that the shard table does not call train, or does not
        know (`split` is the table's, `label` what the trainer wrote into the consumption rows): a
        validation shard merged into a train stream under a `train` label is found all the same.
        `tokenizer_id` is the run's (its launch spec's); None takes each shard's newest record.
        `versions` (shard_id -> content sha256, the run's `shard_versions`): a shard is judged by the record
        of the version the run read, not by a newer version's, whose split may differ."""
        splits = self.shard_splits(tokenizer_id)
        if versions:
            recorded = {
                (r["shard_id"], r["content_sha256"]): r["split"]
                for r in self.shards(tokenizer_id=tokenizer_id, every_version=True)
            }
            splits |= {s: recorded.get((s, sha), "not in the ledger") for s, sha in versions.items()}
        out = []
        for r in self.consumed_by_shard(run_key):
            split = splits.get(r["shard_id"], "not in the ledger")
            if split != "train":
                out.append({**r, "split": split, "label": r["split"]})
        return out


# Ledger.reuse's kinds of a range read twice that nothing declared: the `no_reuse` check fails on them.
UNDECLARED_KINDS = ("reuse", "undeclared_repeat", "undeclared_cross_stage")


def passed_over(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any] | None:
    """Of two parts of one run that read the same range in one epoch: the damaged checkpoint the later
    segment declared it passed over (its `passed_over` entry) when that checkpoint is the one that held
    the earlier segment's part, so the later segment trained those steps again; else None."""
    earlier, later = sorted((a, b), key=lambda p: p["segment"])
    if earlier["segment"] == later["segment"]:
        return None
    declared = json.loads(later.get("passed_over") or "[]")
    return next((d for d in declared if d["step"] == earlier["step_last"]), None)


def source_split_totals(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (source, split) of ledger shard records, sorted: shards, docs, tokens and text_bytes."""
    by: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rows:
        agg = by.setdefault(
            (r["source"], r["split"]),
            {"source": r["source"], "split": r["split"], "shards": 0, "docs": 0, "tokens": 0, "text_bytes": 0},
        )
        agg["shards"] += 1
        for k in ("docs", "tokens", "text_bytes"):
            agg[k] += r[k]
    return [by[k] for k in sorted(by)]


def chain_of(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Of one run's part rows, those that lead to its newest checkpoint (prev_part_id links), oldest first."""
    if not parts:
        return []
    by_id = {p["part_id"]: p for p in parts}
    head = max(parts, key=lambda p: (p["segment"], p["step_last"], p["created_at"]))
    out = []
    cur: dict | None = head
    while cur is not None:
        out.append(cur)
        cur = by_id.get(cur["prev_part_id"] or "")
    return out[::-1]


def chain_totals(chain: list[dict[str, Any]]) -> dict[str, Any]:
    """The four token figures (TokenCounts names), overlap_tokens, steps, segments and parts of a chain."""
    totals: dict[str, Any] = TokenCounts.total(TokenCounts.from_mapping(p) for p in chain).as_dict()
    totals["overlap_tokens"] = sum(p["overlap_tokens"] for p in chain)
    totals["steps"] = chain[-1]["step_last"] if chain else 0
    totals["segments"] = sorted({p["segment"] for p in chain})
    totals["parts"] = len(chain)
    return totals


def run_summaries(ledger: Ledger) -> list[dict[str, Any]]:
    """Per training run in the ledger (in order of its first part): stage, run_key, parent_run_key,
    planned_tokens, tokens_per_step and its `run_totals` (the four TokenCounts figures, steps, ...),
    from one query over the part rows."""
    by_run: dict[str, list[dict[str, Any]]] = {}
    for part in ledger.parts():
        by_run.setdefault(part["run_key"], []).append(part)
    runs = []
    for key, parts in by_run.items():
        first = parts[0]
        runs.append(
            {
                "stage": first["stage"],
                "run_key": key,
                "parent_run_key": first["parent_run_key"] or None,
                "planned_tokens": first["planned_tokens"],
                "tokens_per_step": first["tokens_per_step"],
                **chain_totals(chain_of(parts)),
            }
        )
    return runs


def run_keys(ledger: Ledger, stage: str | None = None) -> list[str]:
    """Run keys in the ledger (of `stage` if given, variants included), in order of their first part."""
    return list(dict.fromkeys(p["run_key"] for p in ledger.parts(stage=stage)))


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


def merge_ranges(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consumption rows (parts' pieces) as ranges per (source, shard, split, epoch): ranges that touch
    (one ends where the next starts) are joined and `parts` counts the pieces joined; overlapping
    ones are kept apart, so a range read twice stays visible."""
    out: list[dict[str, Any]] = []
    key = ("source", "shard_id", "split", "epoch")
    for r in sorted(rows, key=lambda r: (*(r[k] for k in key), r["tok_start"], r["tok_end"])):
        cur = out[-1] if out else None
        if cur is not None and all(cur[k] == r[k] for k in key) and cur["tok_end"] == r["tok_start"]:
            cur.update(
                tok_end=r["tok_end"],
                tokens=cur["tokens"] + r["tokens"],
                parts=cur["parts"] + 1,
                row_start=min(cur["row_start"], r["row_start"]),
                row_end=max(cur["row_end"], r["row_end"]),
            )
            continue
        out.append(
            {
                **{k: r[k] for k in key},
                "tok_start": r["tok_start"],
                "tok_end": r["tok_end"],
                "row_start": r["row_start"],
                "row_end": r["row_end"],
                "tokens": r["tokens"],
                "parts": 1,
            }
        )
    return out


def run_consumption(ledger: Ledger, run_key: str) -> dict[str, Any]:
    """What a run consumed, from the ledger alone, along its chain: segments (steps, world size, real
    tokens), parts, the four token figures (`Ledger.run_counts`), overlap, per shard (tokens, rows,
    epochs) and per range (shard, split, epoch, token range, row range, tokens).
    Raises GhostvisError when the ledger has no part of `run_key`."""
    chain = ledger.chain(run_key)
    if not chain:
        raise GhostvisError(unknown_run_message(ledger, run_key, stage_names()))
    head = chain[-1]
    ranges = merge_ranges(ledger.consumption(chain))
    return {
        "run_key": run_key,
        "stage": head["stage"],
        "parent_run_key": head["parent_run_key"] or None,
        "steps": head["step_last"],
        "parts": len(chain),
        "planned_tokens": head["planned_tokens"],
        "tokens_per_step": head["tokens_per_step"],
        **ledger.run_counts(run_key).as_dict(),
        "overlap_tokens": sum(p["overlap_tokens"] for p in chain),
        "consumed_tokens": sum(r["tokens"] for r in ranges),
        "segments": ledger.segments(run_key),
        "shards": ledger.consumed_by_shard(run_key),
        "ranges": ranges,
    }


def held_out_text_shards(ledger: Ledger, tokenizer_id: str, sources: list[str]) -> dict[str, list[dict[str, str]]]:
    """Of `sources`, in their order, those with plain-text validation shards tokenized with
    `tokenizer_id`: source -> [{"shard_id", "content_sha256", "path"}] (by shard_id)."""
    found: dict[str, list[dict[str, str]]] = {}
    for r in ledger.shards(tokenizer_id=tokenizer_id, sources=list(sources)):
        if r["split"] == "validation" and r["kind"] == "text":
            found.setdefault(r["source"], []).append(
                {"shard_id": r["shard_id"], "content_sha256": r["content_sha256"], "path": r["token_path"]}
            )
    return {s: found[s] for s in sources if s in found}


def duplicate_shards(ledger: Ledger, tokenizer_id: str) -> list[dict[str, Any]]:
    """Shards with the same content hash under different names."""
    by_sha: dict[str, list[str]] = {}
    for r in ledger.shards(tokenizer_id=tokenizer_id):
        by_sha.setdefault(r["content_sha256"], []).append(r["shard_id"])
    return [{"content_sha256": sha, "shards": ids} for sha, ids in by_sha.items() if len(ids) > 1]


def train_validation_overlap(ledger: Ledger, shards: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Documents whose normalised text is in both a train and a validation shard of a source
    (`shards`: the current ledger records, so older versions of a shard do not count)."""
    if not shards:
        return []
    shas = sorted({r["content_sha256"] for r in shards})
    marks = ",".join("?" * len(shas))
    return ledger._query(
        "docs",
        f"""WITH d AS (SELECT DISTINCT * FROM docs WHERE content_sha256 IN ({marks}))
            SELECT v.source, v.doc_hash, v.shard_id AS validation_shard, v.row AS validation_row,
                   t.shard_id AS train_shard, t.row AS train_row
            FROM d v JOIN d t ON v.doc_hash = t.doc_hash AND v.source = t.source
            WHERE v.split = 'validation' AND t.split = 'train' ORDER BY v.shard_id, v.row""",
        shas,
    )


def validation_selected(
    ledger: Ledger, tokenizer_id: str, train_shards: dict[str, tuple[ShardRef, ...]]
) -> list[dict[str, Any]]:
    """Shards selected for training (a launch spec's train_shards) whose ledger split is not train, or
    that the ledger does not know: checked before launch and again by the stage checks, because what
    is selected is what the run may read, whatever it happened to consume."""
    known = {
        (r["shard_id"], r["content_sha256"]): r["split"]
        for r in ledger.shards(tokenizer_id=tokenizer_id, every_version=True)
    }
    out = []
    for source, refs in sorted(train_shards.items()):
        for ref in refs:
            split = known.get((ref.shard_id, ref.content_sha256), "not in the ledger")
            if split != "train":  # the ledger's split; the spec's label is shown, never trusted
                out.append({"source": source, "shard_id": ref.shard_id, "split": split, "spec_split": ref.split})
    return out


def pieces_to_rows(pieces: list[Piece], rows_of) -> list[dict[str, Any]]:
    """Ledger consumption rows for merged pieces; rows_of(piece) -> (row_start, row_end)."""
    out = []
    for p in pieces:
        r0, r1 = rows_of(p)
        out.append(
            {
                "source": p.source,
                "shard_id": p.shard_id,
                "split": p.split,
                "epoch": p.epoch,
                "tok_start": p.tok_start,
                "tok_end": p.tok_end,
                "tokens": p.tokens,
                "row_start": r0,
                "row_end": r1,
            }
        )
    return out

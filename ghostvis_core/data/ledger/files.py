"""Where the ledger's files are and how one is written: the folder of this node's copy, the store it is
published to and fetched from, the file names derived from content keys, and this process's DuckDB
connection. Shared by the writing (`write.py`) and the querying (`query.py`) sides."""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from ghostvis_core.store import Store
from ghostvis_core.store.files import atomic_write

if TYPE_CHECKING:
    import duckdb

    from ghostvis_core.data.ledger.records import PartRow


def write_parquet(
    path: Path, rows: list[dict[str, Any]] | pa.Table, schema: pa.Schema, row_group_size: int | None = None
) -> Path:
    """One ledger file, written whole or not at all (readers never see half a Parquet file)."""
    table = rows if isinstance(rows, pa.Table) else pa.Table.from_pylist(rows, schema=schema)
    out = pa.BufferOutputStream()
    pq.write_table(table, out, row_group_size=row_group_size)
    return atomic_write(path, out.getvalue().to_pybytes())


def file_key(*parts: Any) -> str:
    """A ledger file's name from its content key: writing the same content twice names the same file."""
    return hashlib.sha1("|".join(map(str, parts)).encode()).hexdigest()[:20]


def shard_record_name(shard_id: str, tokenizer_id: str, content_sha256: str) -> str:
    """A shard record's file inside the ledger: one per (shard, tokenizer, content)."""
    return f"shards/{file_key(shard_id, tokenizer_id, content_sha256)}.parquet"


def ngram_name(shard_id: str, content_sha256: str) -> str:
    """A shard's n-gram fingerprints' file inside the ledger: one per (shard, content)."""
    return f"ngrams/{file_key(shard_id, content_sha256)}.parquet"


_process_connection: tuple[int, duckdb.DuckDBPyConnection] | None = None
_connection_lock = threading.Lock()


def connection() -> duckdb.DuckDBPyConnection:
    """This process's DuckDB connection (in memory: the tables are the Parquet files), opened once,
    since opening one costs more than a small query. Queries run on cursors of it, which threads may
    use at once; a forked child (a tokenizer worker) opens its own rather than share its parent's."""
    import duckdb  # here, not at the top: a training rank needs no query before its first step

    global _process_connection
    with _connection_lock:
        if _process_connection is None or _process_connection[0] != os.getpid():
            _process_connection = (os.getpid(), duckdb.connect())
        return _process_connection[1]


def parquet_list(files: list[Path]) -> str:
    """A SQL list literal of file paths, for read_parquet."""
    return "[" + ", ".join("'" + str(f).replace("'", "''") + "'" for f in files) + "]"


@dataclass
class LedgerFiles:
    root: Path  # this node's folder of the ledger's Parquet tables (DuckDB reads local files)
    # where the files live for every node: written files are published to it, and a query first fetches
    # the folders it reads (only those: one table, or one stage's or run's folder). None: `root` is all.
    store: Store | None = None

    @classmethod
    def in_store(cls, store: Store):
        """The ledger of an artifact store (artifact kind "ledger"); nothing is fetched until a query needs it."""
        return cls(store.writable("ledger"), store)

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

    def part_file(self, table: str, part: PartRow) -> Path:
        """Where `table` (one of PART_TABLES) keeps `part`'s rows: the run's folder, one file per part."""
        return (
            self.root
            / table
            / f"stage={part.stage}"
            / f"run={part.run_key}"
            / f"s{part.segment:03d}.p{part.step_last:09d}.parquet"
        )

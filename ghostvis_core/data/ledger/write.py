"""The ledger's writing side: each writer (a tokenizer worker, a training run's rank 0, the audit) writes
its own files, whole, and publishes each to the store at once; nobody rewrites a file. A file's name is
derived from its content key, so writing twice is harmless."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa

from ghostvis_core.data.ledger.files import (
    LedgerFiles,
    connection,
    file_key,
    ngram_name,
    parquet_list,
    shard_record_name,
    write_parquet,
)
from ghostvis_core.data.ledger.records import (
    NGRAM_INDEX_FILES,
    NGRAM_INDEX_ROWS,
    NGRAM_SCHEMA,
    CheckpointFileRow,
    ConsumptionRow,
    DocRow,
    FeedRow,
    NgramRow,
    PartRow,
    RolloutRow,
    RowIndexRow,
    ShardRecord,
    ShareRow,
    TimelineRow,
    schema_of,
    table_of,
)
from ghostvis_core.data.shard_piece import Piece
from ghostvis_core.errors import GhostvisError
from ghostvis_core.store.files import sha256_file


def row_ranges(rows: list[int]) -> list[list[int]]:
    """Global rows as sorted [start, end) ranges; a row read twice appears in two ranges."""
    out: list[list[int]] = []
    for r in sorted(rows):
        if out and out[-1][1] == r:
            out[-1][1] = r + 1
        else:
            out.append([r, r + 1])
    return out


def pieces_to_rows(
    part: PartRow, pieces: list[Piece], rows_of: Callable[[Piece], tuple[int, int]]
) -> list[ConsumptionRow]:
    """The part's consumption rows for its merged pieces; rows_of(piece) -> (row_start, row_end)."""
    return [ConsumptionRow.of(part, p, rows_of(p)) for p in pieces]


class LedgerWriter(LedgerFiles):
    def shard_record_path(self, shard_id: str, tokenizer_id: str, content_sha256: str) -> Path:
        """The local file of a shard's record, fetched from the store when it is there."""
        return self._fetched_file(shard_record_name(shard_id, tokenizer_id, content_sha256))

    def ngram_record_path(self, shard_id: str, content_sha256: str) -> Path:
        """The local file of a shard's n-gram fingerprints, fetched from the store when it is there."""
        return self._fetched_file(ngram_name(shard_id, content_sha256))

    def _write(self, path: Path, table: pa.Table, schema: pa.Schema, row_group_size: int | None = None) -> Path:
        """Write one file of the ledger and publish it to the store, so every node sees it."""
        write_parquet(path, table, schema, row_group_size)
        if self.store is not None:
            self.store.publish("ledger_file", path.relative_to(self.root).as_posix())
        return path

    def _write_records(self, path: Path, record: type, rows: list) -> Path:
        """Write one file of `record`s (`table_of`: the table's schema) and publish it."""
        return self._write(path, table_of(record, rows), schema_of(record))

    def write_shard(self, record: ShardRecord) -> Path:
        """Token paths are kept relative to the store, so a GHOSTVIS_HOME can be moved or copied; the
        token file's sha256 is kept, so a file replaced later (same rows, other tokens) is found."""
        path = Path(record.token_path)
        if path.is_file():
            record = dataclasses.replace(record, token_sha256=sha256_file(path))
        if path.is_absolute() and path.is_relative_to(self.store_folder):
            record = dataclasses.replace(record, token_path=str(path.relative_to(self.store_folder)))
        name = shard_record_name(record.shard_id, record.tokenizer_id, record.content_sha256)
        return self._write_records(self.root / name, ShardRecord, [record])

    def write_doc_hashes(self, shard_id: str, content_sha256: str, rows: list[DocRow]) -> Path:
        """Per document of the shard's content, its hash (text, plus image bytes): finds the same
        document in train and validation."""
        return self._write_records(self.root / "docs" / f"{file_key(shard_id, content_sha256)}.parquet", DocRow, rows)

    def write_ngrams(self, shard_id: str, content_sha256: str, rows: list[NgramRow]) -> Path:
        """Per document of the shard's content (raw row, repeated per fingerprint), its winnowed 13-gram
        hashes: what the decontamination gate compares with the evaluation sets. Keyed like the doc hashes."""
        return self._write_records(self.root / ngram_name(shard_id, content_sha256), NgramRow, rows)

    def write_ngram_index(self) -> Path | None:
        """Every ngrams/ file's fingerprints in one file sorted by hash, so a text is looked up in the few
        row groups its hashes fall in, not in a file per shard (opening one file per shard grows with the shards).
        Named by the files it holds; written again only when a shard's fingerprints were added."""
        self._fetched("ngrams")
        names = sorted(f.name for f in (self.root / "ngrams").glob("*.parquet"))
        if not names:
            return None
        name = f"ngram_index/{file_key(*names)}.parquet"
        if self._fetched_file(name).is_file():
            return self.root / name
        cur = connection().cursor()
        try:
            table = cur.sql(
                f"SELECT * FROM read_parquet({parquet_list([self.root / 'ngrams' / n for n in names])}) "
                "ORDER BY ngram_hash, shard_id, row"
            ).to_arrow_table()
        finally:
            cur.close()
        table = table.cast(NGRAM_SCHEMA).replace_schema_metadata({NGRAM_INDEX_FILES: json.dumps(names)})
        return self._write(self.root / name, table, NGRAM_SCHEMA, NGRAM_INDEX_ROWS)

    def write_part(
        self,
        part: PartRow,
        consumption: list[ConsumptionRow],
        shares: list[ShareRow] | None = None,
        feeds: list[FeedRow] | None = None,
        rollouts: list[RolloutRow] | None = None,
    ) -> None:
        """Consumption, per-rank shares, content digests (when given: the trainer always gives them) and
        an rl run's rollouts first, then the part row: a part row is only visible once what it sums is.
        `consumption` is the part's rows (`pieces_to_rows`); every row names `part` (its part_id and run_key).
        A fixed number of files in the run's folders, whatever the ledger already holds."""
        for k in ("stage", "run_key"):
            value = getattr(part, k)
            if not value or any(c in value for c in "/\\=*?["):
                raise GhostvisError(
                    f"ledger part {part.part_id}: {k} {value!r} cannot name a folder of the "
                    "ledger (empty, or holds one of / \\ = * ? [); give the run another key"
                )
        tables = (
            ("consumption", ConsumptionRow, consumption),
            ("shares", ShareRow, shares),
            ("feeds", FeedRow, feeds),
            ("rollouts", RolloutRow, rollouts),
        )
        for table, record, rows in tables:
            if rows is None:
                continue
            other = {(r.part_id, r.run_key) for r in rows} - {(part.part_id, part.run_key)}
            if other:
                raise GhostvisError(
                    f"ledger part {part.part_id} of run {part.run_key}: its {table} rows name another part "
                    f"{sorted(other)[0]}; build them with the part's part_id and run_key"
                )
            self._write_records(self.part_file(table, part), record, rows)
        self._write_records(self.part_file("parts", part), PartRow, [part])

    def write_checkpoint_files(self, part: PartRow, step: int, digests: dict[str, str]) -> Path:
        """The sha256 of each file of the checkpoint of `step` that `part` commits, in the part's run folder:
        published with the part, so the store's ledger holds them outside the checkpoint."""
        rows = [CheckpointFileRow(part.part_id, part.run_key, step, f, sha) for f, sha in sorted(digests.items())]
        return self._write_records(self.part_file("checkpoint_files", part), CheckpointFileRow, rows)

    def write_row_index(self, chain: list[PartRow], rows: list[RowIndexRow]) -> Path:
        """The audit's row index of a run's chain (each row naming its part and segment): one file, named
        as the chain's head part, sorted by shard and tokens."""
        rows = sorted(rows, key=lambda r: (r.shard_id, r.tok_start, r.global_row))
        return self._write_records(self.part_file("row_index", chain[-1]), RowIndexRow, rows)

    def write_timeline(self, rows: list[TimelineRow], name: str) -> Path | None:
        """A launch's timeline rows since its last write, in its run's folder (`name`: the launch and the point
        it wrote at, so every write is a file of its own); nothing when there are none."""
        if not rows:
            return None
        first = rows[0]
        folder = self.root / "timeline" / f"stage={first.stage}" / f"run={first.run_key}"
        return self._write_records(folder / f"{first.launch_id}.{name}.parquet", TimelineRow, rows)

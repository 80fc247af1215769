"""The ledger's typed rows (ghostvis_core/data/ledger/records.py): each table's Parquet schema is its
record's fields, and the columns are the ones the files on disk have always had, so an old home reads."""

from __future__ import annotations

import dataclasses

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ghostvis_core.counts import TokenCounts
from ghostvis_core.data.ledger import Ledger, records
from ghostvis_core.data.ledger.records import ConsumptionRow, PartRow, ShareRow, schema_of
from ghostvis_core.data.ledger.write import pieces_to_rows
from ghostvis_core.data.shard_piece import Piece
from ghostvis_core.errors import GhostvisError
from ghostvis_core.plan.batch import BatchPlan

FOUR = "real_tokens pad_tokens loss_tokens cropped_tokens"
# Each table's columns as the files hold them (the order included): a record that drifts fails here.
COLUMNS = {
    records.ShardRecord: "shard_id source split kind content_sha256 replaces_sha256 raw_bytes tokenizer_id docs tokens "
    "text_bytes docs_dropped tokens_dropped drop_reasons token_path token_sha256 created_at",
    PartRow: "part_id prev_part_id run_key parent_run_key stage segment step_first step_last rows_first rows_last "
    f"{FOUR} overlap_tokens micro_batch_size seq_len world_size grad_accum_steps tokens_per_step "
    "planned_tokens allow_repeat replay_sources passed_over mlflow_run_id created_at",
    ConsumptionRow: "part_id run_key stage segment source shard_id split epoch tok_start tok_end tokens row_start "
    "row_end",
    ShareRow: f"part_id run_key rank world_size row_count row_ranges {FOUR}",
    records.FeedRow: "part_id run_key rank step step_digest micro_digests micro_rows row_digests image_hashes",
    records.RolloutRow: "part_id run_key rank step generated_tokens rewarded_tokens completions correct_completions "
    "rows completion_ids rewards",
    records.RowIndexRow: "part_id run_key stage segment step rank micro_batch global_row shard_id epoch tok_start "
    "tok_end row_start row_end",
    records.DocRow: "shard_id source split content_sha256 row doc_hash",
    records.NgramRow: "shard_id source split content_sha256 row ngram_hash",
}
SCHEMAS = {
    records.ShardRecord: records.SHARD_SCHEMA,
    PartRow: records.PART_SCHEMA,
    ConsumptionRow: records.CONSUMPTION_SCHEMA,
    ShareRow: records.SHARE_SCHEMA,
    records.FeedRow: records.FEED_SCHEMA,
    records.RolloutRow: records.ROLLOUT_SCHEMA,
    records.RowIndexRow: records.ROW_INDEX_SCHEMA,
    records.DocRow: records.DOC_SCHEMA,
    records.NgramRow: records.NGRAM_SCHEMA,
}


@pytest.mark.parametrize("record", list(COLUMNS), ids=lambda r: r.__name__)
def test_each_tables_schema_is_its_records_fields_in_the_files_column_order(record):
    names = [f.name for f in dataclasses.fields(record)]
    assert SCHEMAS[record].names == names == COLUMNS[record].split()
    assert schema_of(record) == SCHEMAS[record]


def test_a_json_field_is_a_string_column_and_the_rest_are_typed_by_annotation():
    assert schema_of(ShareRow).field("row_ranges").type == pa.string()
    assert [schema_of(records.RolloutRow).field(k).type for k in ("rows", "completion_ids", "rewards")] == [
        pa.string()
    ] * 3
    part = schema_of(PartRow)
    assert (part.field("segment").type, part.field("allow_repeat").type) == (pa.int64(), pa.bool_())
    assert (part.field("created_at").type, part.field("run_key").type) == (pa.float64(), pa.string())


def test_a_part_row_written_reads_back_equal_with_its_counts_batch_and_shares(tmp_path):
    """The trainer's PartRow (without counts), given the ranks' sums, is what the parts table returns."""
    ledger = Ledger(tmp_path / "ledger")
    built = PartRow("r.p0", "", "r", "", "pretrain", 0, 1, 2, 0, 8, micro_batch_size=2, seq_len=4, world_size=2,
                    grad_accum_steps=2, tokens_per_step=32, planned_tokens=64)  # fmt: skip
    part = dataclasses.replace(built, **TokenCounts(60, 4, 58, 1).as_dict())
    share = ShareRow("r.p0", "r", 0, 2, 4, [[0, 2], [4, 6]], **part.counts.as_dict())
    ledger.write_part(part, [], shares=[share])
    (got,) = ledger.parts(["r"])
    assert got == part and got.counts == TokenCounts(60, 4, 58, 1) and got.batch == BatchPlan(2, 4, 2, 2)
    assert pq.read_schema(ledger.part_file("parts", part)).names == COLUMNS[PartRow].split()
    (s,) = ledger.shares([got])
    assert (s.rank, s.row_ranges, s.counts) == (0, [[0, 2], [4, 6]], part.counts)


def test_each_typed_write_makes_its_tables_schema_and_reads_back_equal(tmp_path):
    """write_shard, write_doc_hashes, write_ngrams, write_part (consumption, shares, feeds, rollouts) and
    write_row_index take the records and write files whose schema equals the table's (pyarrow equals), so
    old homes and new files read alike; the consumption row is its Piece with the part's keys and raw rows."""
    ledger = Ledger(tmp_path / "ledger")
    shard = records.ShardRecord(shard_id="p/0", source="p", split="train", kind="text", content_sha256="sha",
                                raw_bytes=9, tokenizer_id="tok", docs=2, tokens=7, text_bytes=9, token_path="",
                                created_at=1.0)  # fmt: skip
    keys = ("p/0", "p", "train", "sha")
    part = PartRow("r.p0", "", "r", "", "pretrain", 0, 1, 1, 0, 2, real_tokens=7)
    piece = Piece("p", "p/0", "train", 0, 0, 7)
    index = records.RowIndexRow("r.p0", "r", "pretrain", 0, 1, 0, 0, 0, "p/0", 0, 0, 7, 0, 2)
    written = {
        records.SHARD_SCHEMA: ledger.write_shard(shard),
        records.DOC_SCHEMA: ledger.write_doc_hashes("p/0", "sha", [records.DocRow(*keys, 0, "h0")]),
        records.NGRAM_SCHEMA: ledger.write_ngrams("p/0", "sha", [records.NgramRow(*keys, 1, 42)]),
        records.ROW_INDEX_SCHEMA: ledger.write_row_index([part], [index]),
    }
    share = ShareRow("r.p0", "r", 0, 1, 2, [[0, 2]], real_tokens=7)
    feed = records.FeedRow("r.p0", "r", 0, 1, "d", ["m"], [[0, 1]], [["r0", "r1"]], [[]])
    rollout = records.RolloutRow("r.p0", "r", 0, 1, 3, 0, 1, 0, [0], [[5, 6, 7]], [0.5])
    ledger.write_part(part, pieces_to_rows(part, [piece], lambda p: (0, 2)), [share], [feed], [rollout])
    beside = {"consumption": records.CONSUMPTION_SCHEMA, "shares": records.SHARE_SCHEMA,
              "feeds": records.FEED_SCHEMA, "rollouts": records.ROLLOUT_SCHEMA}  # fmt: skip
    written.update({schema: ledger.part_file(table, part) for table, schema in beside.items()})
    for schema, path in written.items():
        assert pq.read_schema(path).equals(schema), path
    assert ledger.shards() == [shard]
    assert [(d.row, d.ngram_hashes) for d in ledger.document_fingerprints(["sha"])] == [(1, [42])]
    assert ledger.row_index([written[records.ROW_INDEX_SCHEMA]]) == [index]
    (row,) = ledger.consumption([part])
    assert isinstance(row, Piece) and row == ConsumptionRow.of(part, piece, (0, 2))
    assert (row.tokens, row.part_id, row.segment, row.row_end) == (7, "r.p0", 0, 2)
    assert (ledger.shares([part]), ledger.feeds([part]), ledger.rollouts([part])) == ([share], [feed], [rollout])


def test_a_row_beside_a_part_that_names_another_part_is_refused(tmp_path):
    """write_part writes each row as given: one built with another part's ids would sit in this part's
    file under the other's name, so it is refused, naming both."""
    ledger = Ledger(tmp_path / "ledger")
    part = PartRow("r.p0", "", "r", "", "pretrain", 0, 1, 1, 0, 2)
    stray = ShareRow("r.p9", "r", 0, 1, 2, [[0, 2]])
    with pytest.raises(
        GhostvisError, match=r"ledger part r.p0 of run r: its shares rows name another part \('r.p9', 'r'\)"
    ):
        ledger.write_part(part, [], shares=[stray])
    assert not ledger.part_file("parts", part).exists() and not ledger.part_file("shares", part).exists()

"""Bookkeeping linear in the number of shards (issue 25), on two real backfills of 2 and 6 shards.

Each partition's observation carries that shard's figures only and its materialization no metadata
(the run's counts are the run's one log line), so an event is as large with 6 shards as with 2 (a
table of every shard in each of N events grew the event log as N^2); recording a shard's figures queries the
instance's partition keys no more
often with 6 shards than with 2 (add_asset_metadata(partition_key=...) reloads them per call); a
backfill logs one summary line, not one per shard, and with the team's DAGSTER_EMIT_PARTITION_SUBSET_IN_PLANNED_EVENTS
each shard adds two events (Dagster's materialization, our observation); the datatrove pipeline the executor pickles for
each task is as large for 6 jobs as for 2; `ghostvis status` names the one partition whose input changed.
`benchmarks/scale.py` measures the same at 100 and 1,000 shards.
"""

from __future__ import annotations

import hashlib
import pickle
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ghostvis_core.data.catalog import manifests_of_shards
from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.tokenize_shards import job_for_shard, run_locally, tokenize_shards
from ghostvis_core.home import Home
from tests.test_splits import error_of, latest, observed

SIZES = (2, 6)
VALIDATION = "00001"


def write_shard(path: Path, i: int, version: str = "") -> None:
    """A small FineWeb-schema shard; every shard has the same number of digits in its figures."""
    texts = [
        f"shard {i:05d}{version} paragraph {d}: the ledger counts every token of every shard {d * 7}" for d in range(12)
    ]
    pq.write_table(pa.table({"text": texts}), path)


class Backfill:
    """One home and instance after shard_manifest, raw_shards (one run over every partition), tokenizer and
    tokenized_shards (one run) over n shards served from a file:// url_pattern."""

    def __init__(self, n: int, root: Path):
        from dagster import DagsterInstance

        self.n, self.root, self.home = n, root, root / "home"
        self.published = root / "published"
        self.published.mkdir(parents=True)
        for i in range(n):
            write_shard(self.published / f"{i:05d}.parquet", i)
        self.remote = {
            "name": "web",
            "url_pattern": self.published.as_uri() + "/{shard:05d}.parquet",
            "num_shards": n,
            "validation": [VALIDATION],
        }
        self.instance = DagsterInstance.ephemeral()
        self.pickled_pipeline: list[int] = []
        self.statements: dict[str, list[str]] = {}  # asset -> the SQL its backfill run sent to the instance

    def run(self, assets, *, run_config=None, tags=None, selection=None):
        from dagster import materialize

        from ghostvis_pipeline.launchers import Launcher
        from ghostvis_pipeline.resources import GhostvisHome

        result = materialize(
            assets,
            instance=self.instance,
            run_config=run_config or {},
            tags=tags,
            selection=selection,
            raise_on_error=False,
            resources={"home": GhostvisHome(root=str(self.home)), "launcher": Launcher()},
        )
        assert result.success, error_of(result)
        return result

    def backfill(self, asset, keys: list[str], **kw):
        from ghostvis_pipeline.assets.data import raw_shards, shard_manifest, tokenized_shards, tokenizer
        from ghostvis_pipeline.demo import PARTITION_RANGE_END_TAG, PARTITION_RANGE_START_TAG

        tags = {PARTITION_RANGE_START_TAG: keys[0], PARTITION_RANGE_END_TAG: keys[-1]}
        with sql_statements() as sent:
            result = self.run(
                [shard_manifest, raw_shards, tokenizer, tokenized_shards], tags=tags, selection=[asset], **kw
            )
        self.statements.setdefault(asset.key.to_user_string(), sent)  # the first backfill of the asset
        return result

    def materialize(self) -> Backfill:
        from ghostvis_pipeline.assets.data import raw_shards, shard_manifest, tokenized_shards, tokenizer

        self.run(
            [shard_manifest],
            run_config={"ops": {"shard_manifest": {"config": {"sources": [], "remote": [self.remote]}}}},
        )
        self.keys = self.instance.get_dynamic_partitions("shards")
        self.raw_run = self.backfill(raw_shards, self.keys)
        self.run(
            [raw_shards, tokenizer],
            selection=[tokenizer],
            run_config={"ops": {"tokenizer": {"config": {"vocab_size": 300}}}},
        )
        self.tokenize_in_core()
        self.tokenized_run = self.backfill(
            tokenized_shards, self.keys, run_config={"ops": {"tokenized_shards": {"config": {"workers": 1}}}}
        )
        return self

    def tokenize_in_core(self) -> None:
        """tokenize_shards as the asset calls it, the pipeline's pickled size recorded before it runs."""
        store = Home(self.home).store
        manifests = manifests_of_shards(store, self.keys)
        jobs = [job_for_shard(store, manifests[k], k) for k in self.keys]

        def measured(pipeline, tasks, workers, logging_dir):
            self.pickled_pipeline.append(len(pickle.dumps(pipeline)))
            run_locally(pipeline, tasks, workers, logging_dir)

        tokenize_shards(
            jobs,
            store=store,
            tokenizer_id=latest(self.instance, "tokenizer")["tokenizer_id"],
            logging_dir=self.root / "logs",
            workers=1,
            run_pipeline=measured,
        )

    def event_bytes(self, asset: str, fetch: str = "fetch_materializations") -> list[int]:
        """The serialized size of each partition's newest materialization (or observation) event."""
        from dagster import AssetKey, AssetRecordsFilter, serialize_value

        records = getattr(self.instance, fetch)(AssetRecordsFilter(asset_key=AssetKey(asset)), limit=1000).records
        newest = {}
        for r in records:  # newest first
            newest.setdefault(r.partition_key, len(serialize_value(r.event_log_entry)))
        return list(newest.values())

    def user_log_lines(self, run) -> list[str]:
        return [e.user_message for e in self.instance.all_logs(run.run_id) if e.dagster_event is None]

    def event_types(self, run) -> Counter:
        return Counter(
            e.dagster_event_type.value if e.dagster_event else "log line" for e in self.instance.all_logs(run.run_id)
        )


@contextmanager
def sql_statements():
    """Every SQL statement sent by any SQLAlchemy engine in this process meanwhile (the instance's storage)."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    sent: list[str] = []

    def record(conn, cursor, statement, *args):
        sent.append(statement)

    event.listen(Engine, "before_cursor_execute", record)
    try:
        yield sent
    finally:
        event.remove(Engine, "before_cursor_execute", record)


@pytest.fixture(scope="module")
def backfills(module_tmp) -> dict[int, Backfill]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DAGSTER_EMIT_PARTITION_SUBSET_IN_PLANNED_EVENTS", "true")  # the team setting (README)
        return {n: Backfill(n, module_tmp(f"n{n}")).materialize() for n in SIZES}


def test_each_partition_event_carries_its_own_shards_figures(backfills):
    b = backfills[6]
    store = Home(b.home).store
    ledger = {r.shard_id: r for r in Ledger.in_store(store).shards()}
    for key in b.keys:
        data = (b.published / f"{key.split('/')[1]}.parquet").read_bytes()
        raw = observed(b.instance, "raw_shards", key)
        assert raw == {
            "split": "validation" if key == f"web/{VALIDATION}" else "train",
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
            "status": "downloaded",
            "path": store.uri_of("raw_shard", key),
        }, key
        tok = observed(b.instance, "tokenized_shards", key)
        row = ledger[key]
        assert (
            (tok["docs"], tok["tokens"], tok["docs_dropped"])
            == (row.docs, row.tokens, row.docs_dropped)
            == (12, row.tokens, 0)
        ), key
        assert tok["status"] == "skipped (unchanged)"  # tokenized by tokenize_in_core, same content and tokenizer
        assert latest(b.instance, "raw_shards", key) == latest(b.instance, "tokenized_shards", key) == {}
    manifest = latest(b.instance, "shard_manifest")
    assert (manifest["shards"], manifest["new_partitions"]) == (6, 6)
    assert "| web | text | 6 | 5 | 1 | 0 |" in manifest["by_source"]


def test_event_sizes_and_log_lines_do_not_grow_with_the_backfill(backfills):
    small, big = backfills[2], backfills[6]
    for asset in ("raw_shards", "tokenized_shards"):
        for fetch in ("fetch_materializations", "fetch_observations"):
            sizes_small, sizes_big = small.event_bytes(asset, fetch), big.event_bytes(asset, fetch)
            assert (len(sizes_small), len(sizes_big)) == SIZES
            # the same fields with figures of about the same number of digits: equal up to a few bytes
            assert max(sizes_big) - max(sizes_small) <= 16, (asset, fetch, sizes_small, sizes_big)
    for run in ("raw_run", "tokenized_run"):
        assert len(big.user_log_lines(getattr(big, run))) == len(small.user_log_lines(getattr(small, run))) == 1
    run_bytes = sum(len((big.published / f"{k.split('/')[1]}.parquet").read_bytes()) for k in big.keys)
    assert f"6 shards, 6 downloaded, 0 already present, {run_bytes:,} bytes" in big.user_log_lines(big.raw_run)[0]


def test_each_shard_of_a_backfill_adds_one_materialization_and_one_observation(backfills):
    """With the team's planned-event setting no planned event, log line or other event is per shard."""
    small, big = backfills[2], backfills[6]
    for run in ("raw_run", "tokenized_run"):
        extra = big.event_types(getattr(big, run))
        extra.subtract(small.event_types(getattr(small, run)))
        assert {kind: n for kind, n in extra.items() if n} == {"ASSET_MATERIALIZATION": 4, "ASSET_OBSERVATION": 4}, (
            run,
            extra,
        )
        assert big.event_types(getattr(big, run))["ASSET_MATERIALIZATION_PLANNED"] == 1, run


def test_recording_a_shards_figures_does_not_reload_the_partition_keys_per_shard(backfills):
    """The instance's dynamic partition keys are read as often in a backfill of 6 shards as of 2 (Dagster's
    own fixed reads); add_asset_metadata(partition_key=...) read them once more per shard: N^2 at scale."""

    def key_reads(b: Backfill, asset: str) -> int:
        return sum("FROM dynamic_partitions" in s for s in b.statements[asset])

    for asset in ("raw_shards", "tokenized_shards"):
        small, big = key_reads(backfills[2], asset), key_reads(backfills[6], asset)
        assert 0 < small == big, (asset, small, big)


def test_the_pickled_tokenization_pipeline_does_not_grow_with_the_jobs(backfills):
    small, big = backfills[2].pickled_pipeline, backfills[6].pickled_pipeline
    assert len(small) == len(big) == 1
    assert abs(big[0] - small[0]) <= 16, (small, big)  # paths of the same length in both homes


def test_status_names_the_one_partition_whose_input_changed(backfills):
    from ghostvis_pipeline.assets.data import raw_shards
    from ghostvis_pipeline.definitions import defs
    from ghostvis_pipeline.status_command import statuses

    b = backfills[6]
    before = {s.asset: s for s in statuses(defs, b.instance)}
    assert (before["raw_shards"].partitions, before["tokenized_shards"].partitions) == ("6/6 up to date",) * 2
    write_shard(b.published / "00003.parquet", 3, version="-v2")
    b.backfill(raw_shards, ["web/00003"])
    after = {s.asset: s for s in statuses(defs, b.instance)}
    assert after["tokenized_shards"].state == "stale"
    assert after["tokenized_shards"].partitions == "5/6 up to date"
    assert after["tokenized_shards"].reasons == ["web/00003: input raw_shards changed in partition(s) web/00003"]
    assert after["tokenizer"].reasons == ["input raw_shards changed in partition(s) web/00003"]


def test_a_checks_table_shows_its_first_rows_and_counts_the_rest():
    from ghostvis_core.verify.audit.check_outcome import CheckOutcome
    from ghostvis_pipeline.checks import TABLE_ROWS, to_result

    rows = [[f"web/{i:05d}", i] for i in range(TABLE_ROWS + 5)]
    table = (
        to_result(
            CheckOutcome("c", False, {"shards_disagreeing": len(rows)}, {"disagreeing": (["shard", "n"], rows)}, ["x"])
        )
        .metadata["disagreeing"]
        .value
    )
    assert f"| web/{TABLE_ROWS - 1:05d} | {TABLE_ROWS - 1} |" in table and f"web/{TABLE_ROWS:05d}" not in table
    assert table.endswith("... and 5 more rows (every row: `ghostvis audit --json`)")
    assert (
        to_result(CheckOutcome("c", True, tables={"t": (["shard"], [["web/00000"]])})).metadata["t"].value
        == "| shard |\n|---|\n| web/00000 |"
    )

"""The embedded demo corpus: deterministic, FineWeb-Edu-shaped shards of real stdlib text."""

from __future__ import annotations

import hashlib

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ghostvis_core.data.eval_texts import shipped_texts
from ghostvis_core.data.ngrams import fingerprints, record_text
from ghostvis_core.demo import corpus as demo_corpus
from ghostvis_core.demo.corpus import (
    CODE_MAX_BYTES,
    CODE_MIN_BYTES,
    DEMO_TRAIN_SHARDS,
    PROSE_MAX_BYTES,
    PROSE_MIN_BYTES,
    TEXT_SOURCES,
    build_text_source,
)
from ghostvis_core.demo.tasks import TASK_SOURCES, build_task_source
from ghostvis_core.errors import GhostvisError
from tests.conftest import built_timed

EXPECTED_SCHEMA = {
    "text": pa.string(),
    "id": pa.string(),
    "dump": pa.string(),
    "url": pa.string(),
    "file_path": pa.string(),
    "language": pa.string(),
    "language_score": pa.float64(),
    "token_count": pa.int64(),
}


@pytest.fixture(scope="module")
def built(module_tmp):
    """Both sources built once, with the build time of each."""
    return built_timed(build_text_source, TEXT_SOURCES, module_tmp("corpus"))


def _rows(shards, split=None):
    return [row for path, s in shards if split in (None, s) for row in pq.read_table(path).to_pylist()]


def _sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_rebuild_is_byte_identical(built, tmp_path):
    demo_corpus._split.cache_clear()  # read the stdlib again, not the first build's documents
    demo_corpus._held_out.cache_clear()
    for source in TEXT_SOURCES:
        first, _ = built[source]
        second = build_text_source(source, tmp_path / source)
        assert [p.name for p, _ in first] == [p.name for p, _ in second]
        assert [_sha256(p) for p, _ in first] == [_sha256(p) for p, _ in second]


def test_build_is_fast(built):
    assert sum(seconds for _, seconds in built.values()) < 15


@pytest.mark.parametrize("source", TEXT_SOURCES)
def test_shard_names_and_splits(built, source):
    shards, _ = built[source]
    expected = [f"{i:05d}.parquet" for i in range(DEMO_TRAIN_SHARDS)] + ["val_00000.parquet"]
    assert [p.name for p, _ in shards] == expected
    assert [s for _, s in shards] == ["train"] * DEMO_TRAIN_SHARDS + ["validation"]
    assert sorted(p.name for p in shards[0][0].parent.iterdir()) == expected  # no temp files left

    n_val, n_all = len(_rows(shards, "validation")), len(_rows(shards))
    assert n_val >= 20
    assert n_val == 20 or abs(n_val / n_all - 0.08) < 0.01
    assert all(pq.read_metadata(p).num_rows > 0 for p, _ in shards)


@pytest.mark.parametrize("source", TEXT_SOURCES)
def test_schema_and_columns(built, source):
    shards, _ = built[source]
    for path, _ in shards:
        schema = pq.read_schema(path)
        assert {name: schema.field(name).type for name in schema.names} == EXPECTED_SCHEMA
        meta = pq.read_metadata(path)
        assert all(meta.row_group(i).num_rows <= 1000 for i in range(meta.num_row_groups))
        assert meta.row_group(0).column(0).compression == "ZSTD"

    rows = _rows(shards)
    ids = [r["id"] for r in rows]
    assert len(set(ids)) == len(ids)
    assert len({r["url"] for r in rows}) == len(rows)
    for r in rows:
        assert r["id"] == f"{source}:" + hashlib.sha1(r["text"].encode()).hexdigest()[:16]
        assert r["dump"].startswith("python-3.") and r["dump"].endswith("-stdlib")
        assert r["language"] == ("en" if source == "demo_prose" else "python")
        assert r["language_score"] == 1.0 and r["token_count"] == -1
        assert r["file_path"].endswith(".py") and not r["file_path"].startswith("/")
        parts = r["file_path"].split("/")
        assert not {"test", "tests", "idlelib", "turtledemo", "site-packages"} & set(parts)


def test_prose_is_english_docs_of_bounded_size(built):
    rows = _rows(built["demo_prose"][0])
    assert 1.5e6 < sum(len(r["text"].encode()) for r in rows) < 3e6
    stdlib = [r for r in rows if r["url"].startswith("stdlib://")]
    topics = [r for r in rows if r["url"].startswith("pydoc://topics/")]
    assert len(topics) > 50 and len(stdlib) > 300
    assert all(PROSE_MIN_BYTES <= len(r["text"].encode()) <= PROSE_MAX_BYTES for r in stdlib)
    json_doc = next(r["text"] for r in stdlib if r["url"] == "stdlib://json/decoder.py")
    assert json_doc.startswith("# json.decoder\n\n") and "## JSONDecoder.decode\n\n" in json_doc
    english = sum(all(w in r["text"] for w in (" the ", " and ", " is ")) for r in rows)
    assert english > len(rows) / 3


def test_code_is_python_source_of_bounded_size(built):
    rows = _rows(built["demo_code"][0])
    assert 2e6 < sum(len(r["text"].encode()) for r in rows) <= 3 * 1024 * 1024
    assert all(len(r["text"].encode()) <= CODE_MAX_BYTES for r in rows)
    whole_files = [r for r in rows if "#" not in r["url"]]
    assert all(len(r["text"].encode()) >= CODE_MIN_BYTES for r in whole_files)
    assert sum("def " in r["text"] for r in rows) > len(rows) / 2
    for r in rows:
        assert r["url"] == f"stdlib://{r['file_path']}" or r["url"].startswith(f"stdlib://{r['file_path']}#")


def test_unknown_source_is_a_clear_error(tmp_path):
    with pytest.raises(GhostvisError, match="demo_prose, demo_code"):
        build_text_source("demo_poetry", tmp_path)
    assert not any(tmp_path.iterdir())


def test_no_training_document_of_the_demo_shares_a_fingerprint_with_its_validation(built, tmp_path):
    """From the built shards, across both builders: no training document of any demo source shares a
    13-gram fingerprint with a validation document of any (the code holds the prose's docstrings;
    demo_tasks.py is never checked against the stdlib text, so this is what holds them apart) or with
    a shipped evaluation item."""
    shards = {s: (built[s][0], "text") for s in TEXT_SOURCES}
    shards |= {s: (build_task_source(s, tmp_path / s), kind) for s, kind in TASK_SOURCES.items()}
    fps = {
        (s, split): [fingerprints(record_text(kind, r)) for r in _rows(files, split)]
        for s, (files, kind) in shards.items()
        for split in ("train", "validation")
    }
    held = set().union(
        *(f for (_, split), docs in fps.items() if split == "validation" for f in docs),
        *(fingerprints(t) for t in shipped_texts()),
    )
    assert {s: sum(1 for f in fps[(s, "train")] if f & held) for s in shards} == {s: 0 for s in shards}
    assert all(sum(1 for f in fps[(s, "train")] if f) > 100 for s in shards if s != "demo_images")  # not empty

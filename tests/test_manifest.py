"""The Merkle tree of the training manifest against RFC 9162's definition written here with hashlib,
the audit paths of every leaf, the manifest comparison that names the first difference, and
summary.yaml's validation."""

from __future__ import annotations

import hashlib

import pytest

from ghostvis_core.data.ledger.records import ConsumptionRow
from ghostvis_core.errors import GhostvisError
from ghostvis_core.run.hf.manifest import rows_read
from ghostvis_core.run.hf.merkle import audit_path, leaf_hash, merkle_root, root_from_path
from ghostvis_core.run.hf.summary_input import read_declared
from ghostvis_core.run.hf.verify_model import first_difference


def rfc_root(leaves: list[bytes]) -> bytes:
    """MTH(D[n]) of RFC 9162 2.1.1, recursive on the leaf data itself."""
    if len(leaves) == 1:
        return hashlib.sha256(b"\x00" + leaves[0]).digest()
    k = 1 << ((len(leaves) - 1).bit_length() - 1)
    return hashlib.sha256(b"\x01" + rfc_root(leaves[:k]) + rfc_root(leaves[k:])).digest()


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 9, 16, 48])
def test_the_root_is_rfc_9162s_and_every_leaf_proves_against_it(n):
    data = [f"part\n{i // 2 + 1}\n{i % 2}\n{i:016x}".encode() for i in range(n)]
    hashes = [leaf_hash(d) for d in data]
    root = merkle_root(hashes)
    assert root == rfc_root(data)
    for i in range(n):
        path = audit_path(hashes, i)
        assert root_from_path(hashes[i], i, n, path) == root
        if n > 1:  # a changed sibling, leaf, or index does not reach the root
            bad = [bytes(32)] + path[1:]
            assert root_from_path(hashes[i], i, n, bad) != root
            assert root_from_path(leaf_hash(b"another leaf"), i, n, path) != root
            assert root_from_path(hashes[i], (i + 1) % n, n, path) != root


def test_a_path_of_the_wrong_length_or_index_reaches_no_root():
    hashes = [leaf_hash(bytes([i])) for i in range(5)]
    path = audit_path(hashes, 4)
    assert root_from_path(hashes[4], 4, 5, path + [bytes(32)]) is None
    assert root_from_path(hashes[4], 5, 5, path) is None
    with pytest.raises(IndexError):
        audit_path(hashes, 5)


def test_the_first_difference_is_named_by_its_path_with_both_values():
    shipped = {"stages": [{"tokens": {"real_tokens": 10, "pad_tokens": 0}}, {"steps": 3}]}
    assert first_difference(shipped, shipped) is None
    rebuilt = {"stages": [{"tokens": {"real_tokens": 11, "pad_tokens": 1}}, {"steps": 4}]}
    assert first_difference(shipped, rebuilt) == ".stages[0].tokens.pad_tokens: the manifest says 0, the ledger 1"
    assert first_difference({"a": [1]}, {"a": [1, 2]}) == ".a: 1 entries in the manifest, 2 in the ledger"
    assert first_difference({"a": 1}, {"a": 1, "b": 2}) == ".b: missing from the manifest"


def test_summary_yaml_is_validated_naming_the_field(tmp_path):
    path = tmp_path / "summary.yaml"
    assert read_declared(path) == {}
    with pytest.raises(GhostvisError, match="summary.yaml: no such file; give the path of your summary.yaml"):
        read_declared(path, required=True)
    path.write_text("provider: Example Labs\nlicense: apache-2.0\nsources:\n  demo_prose: {category: web_crawl}\n")
    assert read_declared(path) == {
        "provider": "Example Labs",
        "license": "apache-2.0",
        "sources": {"demo_prose": {"category": "web_crawl"}},
    }
    for text, told in [
        ("licence: mit\n", "unknown field 'licence'"),
        ("provider: [a, b]\n", "provider: give text, not list"),
        ("sources:\n  demo_prose: {category: scraped}\n", "sources.demo_prose.category: 'scraped' is not one of"),
        ("sources:\n  demo_prose: {owner: me}\n", "sources.demo_prose.owner: unknown field"),
    ]:
        path.write_text(text)
        with pytest.raises(GhostvisError, match=told.replace("[", r"\[")):
            read_declared(path)


def test_rows_read_counts_each_raw_row_once_over_overlapping_pieces_and_epochs():
    pieces = [
        ConsumptionRow("p1", "r", "sft", 0, "s", shard, "train", epoch, 0, 10, start, end)
        for shard, epoch, start, end in [
            ("s/0", 0, 0, 3),
            ("s/0", 0, 2, 5),
            ("s/0", 1, 1, 2),
            ("s/0", 0, 7, 8),
            ("s/1", 0, 4, 6),
        ]
    ]
    assert rows_read(pieces) == {"s/0": 6, "s/1": 2}  # rows 0-4 and 7; rows 4-5

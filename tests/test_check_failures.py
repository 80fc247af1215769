"""Blocking checks that fail properly: each test gives a check the data it exists to refuse and asserts
the outcome's message, so a failure path that crashes (a typed record read as a dict) is found here and
not on a user's refresh."""

from __future__ import annotations

from ghostvis_core.data.ledger import Ledger
from ghostvis_core.verify.audit import invariants as inv
from tests.ledger_rows import shard_record


def test_two_shards_with_the_same_content_fail_no_duplicate_content_naming_both(tmp_path):
    """A shard's new version whose content equals another shard's: the check fails and names the pair."""
    ledger = Ledger(tmp_path / "ledger")
    ledger.write_shard(shard_record("demo_prose/00000", sha="a" * 64))
    ledger.write_shard(shard_record("demo_prose/00001", sha="b" * 64))
    ledger.write_shard(shard_record("demo_prose/00001", sha="a" * 64, created_at=2.0))  # its revision
    outcome = inv.no_duplicate_content(ledger, "tok-a")
    assert not outcome.passed
    assert outcome.figures == {"duplicate_shards": 1, "docs_in_train_and_validation": 0}
    assert outcome.failures == ["same content: demo_prose/00000, demo_prose/00001"]
    assert outcome.tables["duplicates"][1] == [["a" * 16, "demo_prose/00000, demo_prose/00001"]]

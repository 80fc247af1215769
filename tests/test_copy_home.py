"""The suite's copy of a GHOSTVIS_HOME (tests/conftest.py: copy_home) while another worker's command
has its SQLite databases open: CI once failed two tests when a reader's close removed an `index.db-shm`
between the copy's listing and its read."""

import os
import shutil
import sqlite3
from pathlib import Path

from tests.conftest import copy_home


def _live_home(root: Path) -> tuple[Path, sqlite3.Connection]:
    """A home whose runs database is open in WAL mode with one write not yet checkpointed, and a
    committed checkpoint step."""
    home = root / "home"
    (home / "store" / "checkpoints" / "pretrain" / "step_000004").mkdir(parents=True)
    (home / "store" / "checkpoints" / "pretrain" / "step_000004" / "model.safetensors").write_bytes(b"weights")
    (home / "dagster").mkdir()
    db = sqlite3.connect(home / "dagster" / "index.db", isolation_level=None)
    db.execute("pragma journal_mode=wal")
    db.execute("pragma wal_autocheckpoint=0")
    db.execute("create table runs (id text)")
    db.execute("insert into runs values ('run-1'), ('run-2')")
    return home, db


def test_a_live_databases_copy_opens_with_every_write_and_leaves_the_connections_index_out(tmp_path):
    home, db = _live_home(tmp_path)
    assert {p.name for p in (home / "dagster").iterdir()} == {"index.db", "index.db-wal", "index.db-shm"}
    copy = copy_home(home, tmp_path / "copy")
    db.close()
    assert {p.name for p in (copy / "dagster").iterdir()} == {"index.db", "index.db-wal"}
    copied = sqlite3.connect(copy / "dagster" / "index.db")
    assert copied.execute("select id from runs order by id").fetchall() == [("run-1",), ("run-2",)]
    copied.close()
    step = "store/checkpoints/pretrain/step_000004/model.safetensors"
    assert os.stat(home / step).st_ino == os.stat(copy / step).st_ino  # write-once: hard-linked


def test_a_wal_removed_by_a_readers_close_during_the_copy_is_skipped_and_anything_else_missing_fails(
    tmp_path, monkeypatch
):
    home, db = _live_home(tmp_path)
    db.execute("pragma wal_checkpoint(truncate)")  # as a reader's close leaves it: every write in index.db
    copy2 = shutil.copy2

    def close_first(source, target):
        if source.endswith(("-wal", "model.safetensors")):
            os.remove(source)
        return copy2(source, target)

    monkeypatch.setattr(shutil, "copy2", close_first)
    monkeypatch.setattr(os, "link", lambda *_: (_ for _ in ()).throw(OSError("another filesystem")))
    try:
        copy_home(home, tmp_path / "copy")
    except shutil.Error as e:  # copytree goes on past a failed file and names each at the end
        assert [Path(source).name for source, _, _ in e.args[0]] == ["model.safetensors"]
    else:
        raise AssertionError("a vanished checkpoint file was copied over silently")
    assert not (tmp_path / "copy" / "dagster" / "index.db-wal").exists()
    copied = sqlite3.connect(tmp_path / "copy" / "dagster" / "index.db")
    assert copied.execute("select count(*) from runs").fetchone() == (2,)
    db.close()

"""A listed source whose file changed after shard_manifest listed it: the download is refused naming the
fix that works (re-list the source with shard_manifest), and after re-listing the same download passes."""

from __future__ import annotations

import pytest

from ghostvis_core.data.catalog import RemoteSource, remote_manifest
from ghostvis_core.data.shard_manifest import fetch_shard
from ghostvis_core.errors import GhostvisError


def test_a_changed_listed_file_is_refused_with_the_relisting_fix_and_passes_once_relisted(tmp_path):
    folder = tmp_path / "my_texts"
    folder.mkdir()
    shard = folder / "00000.jsonl"
    shard.write_text('{"text": "the first version"}\n')
    source = RemoteSource(name="my_texts", listing=folder.as_uri())
    listed = remote_manifest(source)
    shard.write_text('{"text": "the second version, edited by hand"}\n')  # edited after the listing
    dest = tmp_path / "store" / "00000.jsonl"
    with pytest.raises(GhostvisError) as err:
        fetch_shard("my_texts/00000", listed.shards[0], dest)
    message = str(err.value)
    assert "size mismatch (expected 30 bytes, got 47)" in message
    assert "re-materialize shard_manifest (it lists the file's new size and sha256" in message
    relisted = remote_manifest(source)  # the fix: re-materialize shard_manifest
    result = fetch_shard("my_texts/00000", relisted.shards[0], dest)
    assert result.downloaded and result.bytes == relisted.shards[0].bytes == 47
    assert dest.read_text() == '{"text": "the second version, edited by hand"}\n'

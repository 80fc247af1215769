"""A shard revised upstream against what was made of it: the tokenizer's identity splits into what makes it
another tokenizer (vocabulary, byte cap), which asks for a new one, and its training data (the text shards by
content and split), which is named shard by shard with both sha256 and keeps the tokenizer; a run's shards are
compared with the versions its launch spec selected."""

from __future__ import annotations

from ghostvis_core.data.catalog import record_raw_shard, save_manifest
from ghostvis_core.data.data_identities import tokenizer_identity
from ghostvis_core.data.shard_changes import (
    ShardChange,
    describe_changes,
    run_data_changes,
    tokenizer_data_changes,
    training_data_changes,
)
from ghostvis_core.data.shard_manifest import Manifest, ShardEntry
from ghostvis_core.store import FolderStore

OLD, NEW, OTHER = "a" * 64, "b" * 64, "c" * 64


def prose_store(tmp_path) -> tuple[FolderStore, Manifest]:
    """A store with one text source of two downloaded shards (contents OLD and OTHER) and one chat source."""
    store = FolderStore(tmp_path)
    prose = Manifest("prose", "text", [ShardEntry("00000", "file:///p/00000"), ShardEntry("00001", "file:///p/1")])
    chat = Manifest("chat", "chat", [ShardEntry("00000", "file:///c/00000")])
    for manifest in (prose, chat):
        save_manifest(store, manifest)
    record_raw_shard(store, prose, "prose/00000", OTHER, 10)
    record_raw_shard(store, prose, "prose/00001", OLD, 10)
    record_raw_shard(store, chat, "chat/00000", OLD, 10)
    return store, prose


def test_a_revised_text_shard_is_the_tokenizers_training_data_named_with_both_sha256(tmp_path):
    store, prose = prose_store(tmp_path)
    made = tokenizer_identity(store, 512, 1000)
    assert tokenizer_data_changes(store, made) == []
    record_raw_shard(store, prose, "prose/00001", NEW, 12)  # revised upstream
    assert tokenizer_data_changes(store, made) == [ShardChange("prose/00001", OLD, NEW, "train", "train")]
    asked = tokenizer_identity(store, 512, 1000)
    assert training_data_changes(made, asked) == [ShardChange("prose/00001", OLD, NEW, "train", "train")]
    assert describe_changes(training_data_changes(made, asked), 5) == f"prose/00001 (sha256 {OLD} -> {NEW})"


def test_another_vocabulary_or_byte_cap_asks_for_another_tokenizer_not_a_kept_one(tmp_path):
    store, prose = prose_store(tmp_path)
    made = tokenizer_identity(store, 512, 1000)
    assert training_data_changes(made, tokenizer_identity(store, 512, 1000)) == []
    assert training_data_changes(made, tokenizer_identity(store, 1024, 1000)) is None
    assert training_data_changes(made, tokenizer_identity(store, 512, 2000)) is None
    record_raw_shard(store, prose, "prose/00001", NEW, 12)
    assert training_data_changes(made, tokenizer_identity(store, 1024, 1000)) is None


def test_a_chat_shard_is_no_training_data_of_the_tokenizer_but_a_pinned_split_is(tmp_path):
    store, prose = prose_store(tmp_path)
    made = tokenizer_identity(store, 512, 1000)
    chat = Manifest("chat", "chat", [ShardEntry("00000", "file:///c/00000")])
    record_raw_shard(store, chat, "chat/00000", NEW, 12)
    assert tokenizer_data_changes(store, made) == []
    pinned = Manifest("prose", "text", prose.shards, validation_sha256=[OTHER])  # prose/00000 pinned by content
    save_manifest(store, pinned)
    [change] = tokenizer_data_changes(store, made)
    assert change == ShardChange("prose/00000", OTHER, OTHER, "train", "validation")
    assert change.describe() == f"prose/00000 (sha256 {OTHER} -> {OTHER}, split train -> validation)"


def test_a_run_names_the_shards_it_trained_whose_content_changed_since(tmp_path):
    store, prose = prose_store(tmp_path)
    versions = {"prose/00000": OTHER, "prose/00001": OLD, "chat/00000": OLD}
    assert run_data_changes(store, versions) == []
    record_raw_shard(store, prose, "prose/00001", NEW, 12)
    assert run_data_changes(store, versions) == [ShardChange("prose/00001", OLD, NEW)]
    assert run_data_changes(store, {**versions, "prose/00001": ""}) == []  # a spec without content hashes
    many = [ShardChange(f"prose/{i:05d}", OLD, NEW) for i in range(7)]
    assert describe_changes(many, 5).endswith(f"prose/00004 (sha256 {OLD} -> {NEW}); and 2 more")

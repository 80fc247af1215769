"""The BPE tokenizer: trained on the demo corpus, served by tiktoken, stored and loaded safely."""

from __future__ import annotations

import hashlib
import json
import time

import numpy as np
import pyarrow.parquet as pq
import pytest
import tiktoken
import tiktoken.load

from ghostvis_core.data.bpe_tokenizer import (
    SPECIAL_TOKENS,
    load_tokenizer,
    save_tokenizer,
    train_tokenizer,
)
from ghostvis_core.demo.corpus import TEXT_SOURCES, build_text_source
from ghostvis_core.errors import GhostvisError
from ghostvis_core.store import FolderStore

SAMPLES = [
    "",
    "Hello, world! It's a test; we'll see what they've done.",
    "naïve café — Ünïcödé: 日本語のテキスト, 한국어, العربية, עברית",
    "emoji 🙂👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    "   leading and trailing spaces   \n\n\n\t\t  \r\n  mixed\r\n",
    "numbers 1234567890 3.14159 1e-10 0xFF",
    "<|bos|> literal specials <|eot|><|pad|> in text",
    "\x00\x01 control characters \x7f\x1b[0m",
]


@pytest.fixture(scope="module")
def corpus(module_tmp):
    """{split: texts} of both demo sources, built once for this module."""
    root = module_tmp("corpus")
    texts = {"train": [], "validation": []}
    for source in TEXT_SOURCES:
        for path, split in build_text_source(source, root / source):
            texts[split] += pq.read_table(path, columns=["text"]).column("text").to_pylist()
    return texts


@pytest.fixture(scope="module")
def tok(corpus):
    return train_tokenizer(corpus["train"], vocab_size=4096)


def test_vocab_and_special_ids(tok):
    assert tok.vocab_size == 4096
    assert tok.tokenizer_id.startswith("bpe4096-")
    ids = [tok.special(name) for name in SPECIAL_TOKENS]
    assert ids == list(range(4096 - 7, 4096))
    assert (tok.bos, tok.eot) == (4089, 4090)
    assert tok.special("<|user|>") == 4092
    with pytest.raises(GhostvisError, match="<\\|nope\\|>"):
        tok.special("<|nope|>")


def test_round_trip(tok):
    for text in SAMPLES:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode_batch(SAMPLES, num_threads=2) == [tok.encode(t) for t in SAMPLES]
    assert tok.decode(np.array(tok.encode(SAMPLES[1]), dtype=np.uint16)) == SAMPLES[1]


def test_literal_specials_are_ordinary_text(tok):
    text = "before <|bos|> middle <|eot|><|assistant|> after"
    ids = tok.encode(text)
    assert max(ids) < tok.vocab_size - len(SPECIAL_TOKENS)
    assert tok.decode(ids) == text


def test_single_bytes_have_ranks_0_to_255(tok):
    assert [tok.enc.encode_single_token(bytes([b])) for b in range(256)] == list(range(256))


def test_compression_on_held_out_text(tok, corpus):
    held_out = corpus["validation"]
    n_bytes = sum(len(t.encode()) for t in held_out)
    n_tokens = sum(map(len, tok.encode_batch(held_out)))
    assert n_bytes / n_tokens > 3.3  # measured 3.61 at vocab 4096


def test_training_is_deterministic_and_id_tracks_vocab(corpus):
    subset = corpus["train"][:100]
    a, b = train_tokenizer(subset, 512), train_tokenizer(subset, 512)
    assert a.tokenizer_id == b.tokenizer_id and a.enc._mergeable_ranks == b.enc._mergeable_ranks
    c = train_tokenizer(subset, 600)
    assert c.tokenizer_id != a.tokenizer_id and c.tokenizer_id.startswith("bpe600-")
    with pytest.raises(GhostvisError, match="at least 263"):
        train_tokenizer(subset, 262)


def test_save_and_load(tok, tmp_path, monkeypatch):
    store = FolderStore(tmp_path)
    directory = save_tokenizer(tok, store)
    assert directory == store.fetch("tokenizer", tok.tokenizer_id) == tmp_path / "tokenizers" / tok.tokenizer_id
    assert sorted(p.name for p in directory.parent.iterdir()) == [tok.tokenizer_id]  # no temp dir left
    assert save_tokenizer(tok, store) == directory  # already there: nothing to do

    meta = json.loads((directory / "tokenizer.json").read_text())
    assert meta["tokenizer_id"] == tok.tokenizer_id and meta["vocab_size"] == 4096
    assert meta["special_tokens"] == {name: 4089 + i for i, name in enumerate(SPECIAL_TOKENS)}
    assert meta["ranks_sha256"] == hashlib.sha256((directory / "ranks.tiktoken").read_bytes()).hexdigest()
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # read the file directly, do not cache it
    assert tiktoken.load.load_tiktoken_bpe(str(directory / "ranks.tiktoken")) == tok.enc._mergeable_ranks

    for loaded in (load_tokenizer(tok.tokenizer_id, store), load_tokenizer(str(directory)), load_tokenizer(directory)):
        assert loaded.tokenizer_id == tok.tokenizer_id
        assert loaded.encode_batch(SAMPLES) == tok.encode_batch(SAMPLES)
        assert [loaded.special(n) for n in SPECIAL_TOKENS] == [tok.special(n) for n in SPECIAL_TOKENS]


def test_tampered_or_missing_files_fail_loading(tok, tmp_path):
    store = FolderStore(tmp_path)
    directory = save_tokenizer(tok, store)
    ranks = directory / "ranks.tiktoken"
    lines = ranks.read_bytes().splitlines(keepends=True)
    ranks.write_bytes(b"".join(lines[:300] + [lines[301], lines[300]] + lines[302:]))  # swap two ranks
    with pytest.raises(GhostvisError, match="ranks.tiktoken.*re-materialize the `tokenizer` asset"):
        load_tokenizer(tok.tokenizer_id, store)

    ranks.unlink()
    with pytest.raises(GhostvisError, match="ranks.tiktoken.*re-materialize the `tokenizer` asset"):
        load_tokenizer(tok.tokenizer_id, store)

    with pytest.raises(GhostvisError, match="not found"):
        load_tokenizer("bpe4096-000000000000", store)


def test_standard_encoding_without_cache_fails_fast(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    seen = []

    def no_network(blobpath):
        seen.append(blobpath)
        raise ConnectionError("network used")

    monkeypatch.setattr(tiktoken.load, "read_file", no_network)
    start = time.perf_counter()
    with pytest.raises(GhostvisError, match="materialize the `tokenizer` asset") as info:
        load_tokenizer("cl100k_base")
    assert time.perf_counter() - start < 2
    assert seen == []

    # The file we look for is the one tiktoken itself would read from its cache.
    with pytest.raises(ConnectionError):
        tiktoken.get_encoding("cl100k_base")
    assert str(tmp_path / hashlib.sha1(seen[0].encode()).hexdigest()) in str(info.value)

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")
    with pytest.raises(GhostvisError, match="TIKTOKEN_CACHE_DIR is empty"):
        load_tokenizer("gpt2")

"""Silent corruption of tokenization (issue 43, item 4): the token ledger's checks that look inside the
token files. Real tokenization (datatrove, the GhostVis tokenizer) of a text shard and a chat shard;
then each bug a tokenizer could make while counting right is planted in a copy of the store, with the
ledger re-recorded as the buggy writer would (so `ledger_matches_token_files` still passes), and the
named check must fail naming the shard and document.
"""

from __future__ import annotations

import dataclasses
import random
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest

from ghostvis_core.data.bpe_tokenizer import save_tokenizer, train_tokenizer
from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.token_shard import list_column, write_token_shard
from ghostvis_core.data.tokenize_shards import TokenizeJob
from ghostvis_core.store import FolderStore
from ghostvis_core.verify.audit.invariants import ledger_matches_token_files
from ghostvis_core.verify.audit.token_files import TokenFile
from ghostvis_core.verify.audit.token_integrity import (
    documents_start_where_ledger_says,
    sampled_documents_decode_to_raw_text,
    token_files_name_their_tokenizer,
)
from tests.raw_shards import raw_shard_job, tokenize_here

WORDS = [f"{a}{b}" for a in ("ka", "lo", "mi", "nu", "pe", "ra") for b in ("bar", "cen", "dol", "fim", "gat")]
CHECKS = (token_files_name_their_tokenizer, documents_start_where_ledger_says, sampled_documents_decode_to_raw_text)


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)) + "."


def tokenize(store: FolderStore, root: Path, tok, jobs: list[TokenizeJob]) -> None:
    tokenize_here(jobs, store, tok.tokenizer_id, root / "logs" / tok.tokenizer_id)


@pytest.fixture(scope="module")
def tokenized(module_tmp) -> SimpleNamespace:
    """A store with tokenizer `tok` (and a second, `other`), a text shard corp/00000 of 5 documents and
    a chat shard chat/00000 of 3 conversations (one with an image placeholder), tokenized by `tok`;
    corp/00000 also tokenized by `other` (its token file lies under `other`'s id)."""
    root = module_tmp("token_integrity")
    store, rng = FolderStore(root / "store"), random.Random(43)
    docs = [text(rng, 30 + 7 * i) for i in range(5)]
    chats = [
        [{"role": "user", "content": text(rng, 6)}, {"role": "assistant", "content": text(rng, 9)}],
        [{"role": "user", "content": f"<|image|> {text(rng, 5)}"}, {"role": "assistant", "content": text(rng, 4)}],
        [{"role": "system", "content": text(rng, 3)}, {"role": "user", "content": text(rng, 7)}],
    ]
    tok, other = train_tokenizer(docs, 400), train_tokenizer(docs[:2], 300)
    for t in (tok, other):
        save_tokenizer(t, store)
    jobs = [
        raw_shard_job(store, "corp/00000", pa.table({"text": docs})),
        raw_shard_job(store, "chat/00000", pa.table({"messages": chats}), kind="chat"),
    ]
    tokenize(store, root, tok, jobs)
    tokenize(store, root, other, jobs[:1])
    return SimpleNamespace(root=root, tok=tok, other=other, docs=docs)


def token_path(store: FolderStore, tokenizer_id: str, shard_id: str) -> Path:
    """The token file of the shard's current content (token files are keyed by the raw content they hold)."""
    (record,) = [r for r in Ledger.in_store(store).shards(tokenizer_id=tokenizer_id) if r.shard_id == shard_id]
    return store.fetch("token_shard", tokenizer_id, shard_id, record.content_sha256)


def copy_of(t: SimpleNamespace, dst: Path) -> tuple[FolderStore, Ledger]:
    shutil.copytree(t.root / "store", dst)
    store = FolderStore(dst)
    return store, Ledger.in_store(store)


def rewrite(store: FolderStore, ledger: Ledger, tokenizer_id: str, shard_id: str, tf: TokenFile, starts, values):
    """Replace the token file with these documents' tokens and re-record its ledger row from the new
    file (docs, tokens, sha256): what a buggy tokenizer that counts right leaves behind."""
    path = token_path(store, tokenizer_id, shard_id)
    lengths = np.diff(starts).tolist()
    columns = {"row": pa.array(tf.rows), "tokens": list_column(lengths, list(values), np.uint16)}
    write_token_shard(path, columns, tf.tokenizer_id)
    record = next(r for r in ledger.shards(tokenizer_id=tokenizer_id) if r.shard_id == shard_id)
    ledger.write_shard(dataclasses.replace(record, tokens=int(sum(lengths)), token_path=str(path)))


def outcomes(store: FolderStore, ledger: Ledger, tokenizer_id: str) -> dict:
    return {check.__name__: check(store, ledger, tokenizer_id) for check in CHECKS}


def test_real_tokenization_passes_and_names_its_tokenizer_in_every_file(tokenized, tmp_path):
    store, ledger = copy_of(tokenized, tmp_path / "store")
    tok = tokenized.tok
    out = outcomes(store, ledger, tok.tokenizer_id)
    assert all(o.passed for o in out.values()), {n: o.failures for n, o in out.items()}
    assert out["documents_start_where_ledger_says"].figures["documents"] == 8
    assert out["sampled_documents_decode_to_raw_text"].figures["sampled_documents"] == 6  # 3 per shard
    tf = TokenFile(token_path(store, tok.tokenizer_id, "chat/00000"), "chat/00000")
    assert tf.tokenizer_id == tok.tokenizer_id and tf.doc(0)[0] == tok.bos and tf.doc(2)[-1] == tok.eot


def test_a_swapped_tokenizer_fails_by_name(tokenized, tmp_path):
    """corp/00000 tokenized by `other`, its file put where `tok`'s is read from and recorded as `tok`'s."""
    store, ledger = copy_of(tokenized, tmp_path / "store")
    tok, other = tokenized.tok, tokenized.other
    swapped = token_path(store, other.tokenizer_id, "corp/00000")
    tf = TokenFile(swapped, "corp/00000")
    path = token_path(store, tok.tokenizer_id, "corp/00000")
    shutil.copyfile(swapped, path)
    record = next(r for r in ledger.shards(tokenizer_id=tok.tokenizer_id) if r.shard_id == "corp/00000")
    ledger.write_shard(dataclasses.replace(record, tokens=tf.num_tokens, token_path=str(path)))
    assert ledger_matches_token_files(store, ledger, tok.tokenizer_id).passed  # counts right: the old checks pass
    out = outcomes(store, ledger, tok.tokenizer_id)
    assert not out["token_files_name_their_tokenizer"].passed
    assert out["token_files_name_their_tokenizer"].failures == [
        f"token file of corp/00000 was made by tokenizer {other.tokenizer_id}, not {tok.tokenizer_id} that the "
        "ledger and the stages read it as; re-materialize tokenized_shards partition corp/00000"
    ]
    decoded = out["sampled_documents_decode_to_raw_text"]
    assert not decoded.passed and decoded.figures["mismatched_documents"] == 3
    assert decoded.failures[0].startswith("shard corp/00000 document 0 decodes to other words than raw row 0")


def test_a_dropped_bos_fails_by_document_and_row(tokenized, tmp_path):
    store, ledger = copy_of(tokenized, tmp_path / "store")
    tok = tokenized.tok
    tf = TokenFile(token_path(store, tok.tokenizer_id, "corp/00000"), "corp/00000")
    a = int(tf.starts[2])
    values = np.delete(tf.values, a)  # document 2 loses its <|bos|>
    starts = np.concatenate((tf.starts[:3], tf.starts[3:] - 1))
    rewrite(store, ledger, tok.tokenizer_id, "corp/00000", tf, starts, values)
    assert ledger_matches_token_files(store, ledger, tok.tokenizer_id).passed
    out = outcomes(store, ledger, tok.tokenizer_id)
    check = out["documents_start_where_ledger_says"]
    assert not check.passed and check.figures["bad_documents"] == 1
    assert check.failures == [
        f"shard corp/00000 document 2 (raw row 2) starts with token {int(tf.values[a + 1])}, not <|bos|> "
        f"({tok.bos}): a dropped BOS or a shifted document boundary; re-materialize tokenized_shards partition "
        "corp/00000"
    ]
    assert out["token_files_name_their_tokenizer"].passed and out["sampled_documents_decode_to_raw_text"].passed


def test_a_shifted_document_boundary_fails_by_document_and_row(tokenized, tmp_path):
    store, ledger = copy_of(tokenized, tmp_path / "store")
    tok = tokenized.tok
    tf = TokenFile(token_path(store, tok.tokenizer_id, "chat/00000"), "chat/00000")
    starts = tf.starts.copy()
    starts[1] += 1  # conversation 0 takes conversation 1's <|bos|>
    rewrite(store, ledger, tok.tokenizer_id, "chat/00000", tf, starts, tf.values)
    assert ledger_matches_token_files(store, ledger, tok.tokenizer_id).passed
    check = documents_start_where_ledger_says(store, ledger, tok.tokenizer_id)
    assert not check.passed and check.figures["bad_documents"] == 2
    assert [row[:3] for row in check.tables["problems"][1]] == [
        ["chat/00000", 1, 1],  # starts with <|user|>
        ["chat/00000", 0, 0],  # holds <|bos|> at its end
        ["chat/00000", 0, 0],  # ends with <|bos|>, not <|eot|>
    ]
    assert "document 0 (raw row 0) holds <|bos|> at token" in check.failures[1]

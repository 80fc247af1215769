"""Silent corruption of tokenization: token files that count right but hold the wrong tokens.

`ledger_matches_token_files` proves a file has the documents and tokens its ledger record says, and is
the file that was recorded; a tokenizer bug that writes consistent but wrong files passes it. Three
blocking checks of the token ledger look inside:
- `token_files_name_their_tokenizer`: every file's schema metadata names the tokenizer the ledger
  record (and the path the stages read it from) says made it: a shard tokenized by another tokenizer
  (a swap) is named, and so is a file written before tokenizers were recorded;
- `documents_start_where_ledger_says`: <|bos|> stands exactly at each document's start in the file
  (every kind begins with it: ghostvis_core/data/tokenize_shards.py encode_document) and nowhere else, and
  chats, preference pairs and captions end with <|eot|>: a dropped BOS or a shifted document boundary
  is named by document and raw row;
- `sampled_documents_decode_to_raw_text`: the first, middle and last document of every shard,
  decoded (the segments between special tokens), have the normalized words of their raw row
  (ngrams.record_text): a swapped tokenizer or a document paired with another row's tokens is named.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow.parquet as pq

from ghostvis_core.data.bpe_tokenizer import Tokenizer, load_tokenizer
from ghostvis_core.data.catalog import raw_content
from ghostvis_core.data.chat import ROLES, marker_starts
from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.ledger.records import ShardRecord
from ghostvis_core.data.ngrams import TEXT_COLUMNS, normalize, record_text
from ghostvis_core.errors import GhostvisError
from ghostvis_core.store import Store
from ghostvis_core.verify.audit.check_outcome import CheckOutcome
from ghostvis_core.verify.audit.token_files import TokenFile

NAMED = 20  # problems named one by one in a check's failures
ENDS_WITH_EOT = ("chat", "preference", "problem", "image_caption")
IMAGE = "<|image|>"  # a chat's image placeholder: a special token in the file, literal text in the raw row


def _files(store: Store, ledger: Ledger, tokenizer_id: str) -> list[tuple[ShardRecord, TokenFile | str]]:
    """Each ledger shard record of the tokenizer, every version of a shard (a run may have trained an
    earlier one), with its token file, or why the file cannot be read."""
    out: list[tuple[ShardRecord, TokenFile | str]] = []
    for r in ledger.shards(tokenizer_id=tokenizer_id, every_version=True):
        try:
            path = store.fetch("token_shard", tokenizer_id, r.shard_id, r.content_sha256)
            out.append((r, TokenFile(path, r.shard_id)))
        except GhostvisError as exc:
            out.append((r, str(exc)))
    return out


def _outcome(name: str, problems: list[list[Any]], header: list[str], figures: dict[str, Any]) -> CheckOutcome:
    failures = [row[-1] for row in problems[:NAMED]]
    if len(problems) > NAMED:
        failures.append(f"... and {len(problems) - NAMED} more")
    return CheckOutcome(name, not problems, figures, {"problems": (header, problems[:NAMED])}, failures)


def token_files_name_their_tokenizer(store: Store, ledger: Ledger, tokenizer_id: str) -> CheckOutcome:
    """Every token file of the tokenizer was written by it (the id in the file's schema metadata)."""
    problems, files = [], _files(store, ledger, tokenizer_id)
    for r, tf in files:
        s, fix = r.shard_id, f"re-materialize tokenized_shards partition {r.shard_id}"
        if isinstance(tf, str):
            problems.append([s, "-", tf])
        elif tf.tokenizer_id != tokenizer_id:
            made_by = (
                f"tokenizer {tf.tokenizer_id}"
                if tf.tokenizer_id
                else "an unrecorded tokenizer (written before tokenizer ids were recorded)"
            )
            problems.append(
                [
                    s,
                    tf.tokenizer_id or "-",
                    f"token file of {s} was made by {made_by}, not {tokenizer_id} that the "
                    f"ledger and the stages read it as; {fix}",
                ]
            )
    return _outcome(
        "token_files_name_their_tokenizer",
        problems,
        ["shard", "file's tokenizer", "problem"],
        {"tokenizer_id": tokenizer_id, "token_files": len(files), "files_of_another_tokenizer": len(problems)},
    )


def boundary_problems(r: ShardRecord, tf: TokenFile, tok: Tokenizer) -> list[list[Any]]:
    """[shard, document, raw row, problem] for each document that does not start with <|bos|>, each
    <|bos|> inside a document, and each chat / pair / caption that does not end with <|eot|>."""
    s, starts, values = r.shard_id, tf.starts, tf.values
    lengths = np.diff(starts)
    firsts = np.where(lengths > 0, values[np.minimum(starts[:-1], max(len(values) - 1, 0))], -1)
    out = [
        [
            s,
            int(d),
            int(tf.rows[d]),
            f"shard {s} document {d} (raw row {tf.rows[d]}) starts with token "
            f"{int(firsts[d])}, not <|bos|> ({tok.bos}): a dropped BOS or a shifted document boundary",
        ]
        for d in np.flatnonzero(firsts != tok.bos)
    ]
    if r.kind == "text" or tok.bos != tok.eot:  # a standard encoding's <|endoftext|> is both
        inside = np.setdiff1d(np.flatnonzero(values == tok.bos), starts[:-1])
        for p in inside:
            d = int(np.searchsorted(starts, p, side="right")) - 1
            out.append(
                [
                    s,
                    d,
                    int(tf.rows[d]),
                    f"shard {s} document {d} (raw row {tf.rows[d]}) holds <|bos|> at "
                    f"token {int(p - starts[d])}: a document boundary is missing or shifted",
                ]
            )
    if r.kind in ENDS_WITH_EOT:
        lasts = np.where(lengths > 0, values[np.maximum(starts[1:] - 1, 0)], -1)
        out += [
            [
                s,
                int(d),
                int(tf.rows[d]),
                f"shard {s} document {d} (raw row {tf.rows[d]}) ends with token "
                f"{int(lasts[d])}, not <|eot|> ({tok.eot}): a dropped EOT or a shifted document boundary",
            ]
            for d in np.flatnonzero(lasts != tok.eot)
        ]
    return out


def documents_start_where_ledger_says(store: Store, ledger: Ledger, tokenizer_id: str) -> CheckOutcome:
    """<|bos|> at every document start of every token file and nowhere else; <|eot|> closing every
    chat, preference pair and caption."""
    tok, problems, docs = load_tokenizer(tokenizer_id, store), [], 0
    for r, tf in _files(store, ledger, tokenizer_id):
        if isinstance(tf, str):
            problems.append([r.shard_id, "-", "-", tf])
            continue
        docs += tf.num_docs
        problems += boundary_problems(r, tf, tok)
    for p in problems:
        p[-1] += f"; re-materialize tokenized_shards partition {p[0]}"
    return _outcome(
        "documents_start_where_ledger_says",
        problems,
        ["shard", "document", "raw row", "problem"],
        {"documents": docs, "bos": tok.bos, "eot": tok.eot, "bad_documents": len({(p[0], p[1]) for p in problems})},
    )


def decoded_words(tok: Tokenizer, ids: np.ndarray) -> list[str]:
    """The normalized words of a document's tokens: each run between special tokens decoded on its own. A role
    marker of several tokens (a brought tokenizer's "<|im_start|>user\n") counts as one special: its words are
    the template's, not the row's."""
    specials = [tok.enc.encode_single_token(t) for t in sorted(tok.enc.special_tokens_set)]
    ids, keep = np.array(ids), np.ones(len(ids), bool)  # a copy: the file's tokens stay as they are
    for marker in (tok.marker(f"<|{r}|>") for r in ROLES if f"<|{r}|>" in tok.markers):
        for i in marker_starts(ids, marker) if len(marker) > 1 else []:
            ids[i], keep[i + 1 : i + len(marker)] = specials[0], False
    ids = ids[keep]
    bounds = [-1, *np.flatnonzero(np.isin(ids, specials)).tolist(), len(ids)]
    return [w for a, b in zip(bounds, bounds[1:]) if b - a > 1 for w in normalize(tok.decode(ids[a + 1 : b]))]


def sampled_documents_decode_to_raw_text(store: Store, ledger: Ledger, tokenizer_id: str) -> CheckOutcome:
    """The first, middle and last document of every token file decode to the words of their raw row."""
    tok, problems, sampled = load_tokenizer(tokenizer_id, store), [], 0
    for r, tf in _files(store, ledger, tokenizer_id):
        s = r.shard_id
        if isinstance(tf, str) or tf.num_docs == 0:
            problems += [[s, "-", "-", tf]] if isinstance(tf, str) else []
            continue
        picks = sorted({0, tf.num_docs // 2, tf.num_docs - 1})
        try:  # the raw version this token file was made from (a shard is its content)
            raw = raw_content(store, s, r.content_sha256)
        except GhostvisError as exc:
            problems.append([s, "-", "-", str(exc)])
            continue
        table = pq.read_table(raw, columns=TEXT_COLUMNS[r.kind])
        records = table.take([int(tf.rows[d]) for d in picks]).to_pylist()
        for d, record in zip(picks, records):
            sampled += 1
            text = record_text(r.kind, record)
            want = normalize(text if r.kind == "text" else text.replace(IMAGE, " "))
            got = decoded_words(tok, tf.doc(d))
            if got != want:
                at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                problems.append(
                    [
                        s,
                        d,
                        int(tf.rows[d]),
                        f"shard {s} document {d} decodes to other words than raw row "
                        f"{tf.rows[d]} (word {at}: {' '.join(got[at : at + 6])!r} in the tokens, "
                        f"{' '.join(want[at : at + 6])!r} in the raw text): tokenized with another tokenizer or "
                        f"paired with another row; re-materialize tokenized_shards partition {s}",
                    ]
                )
    return _outcome(
        "sampled_documents_decode_to_raw_text",
        problems,
        ["shard", "document", "raw row", "problem"],
        {"sampled_documents": sampled, "mismatched_documents": len(problems)},
    )

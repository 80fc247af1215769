"""Word n-gram fingerprints of a text, the unit of the decontamination gate.

As in the GPT-3 and Marin decontamination: a text is normalized to words (lowercased; every run of
characters that are neither letters nor digits separates words, so punctuation, markup and
whitespace do not matter), and every 13 consecutive words form one n-gram, hashed to a signed 64-bit
integer (blake2b of the words joined by single spaces).

Storing every n-gram of every training document would cost 8 bytes per word of the corpus, so the
ledger keeps a deterministic sample chosen by winnowing (Schleimer, Wilkerson, Aiken 2003): of every
WINDOW consecutive n-gram hashes, the smallest is kept. The kept set depends only on the text, both
sides of a comparison are sampled by the same rule, and it comes with a guarantee a random sample
lacks: two texts that share a run of at least NGRAM + WINDOW - 1 (= 20) words share a fingerprint.
About 2 / (WINDOW + 1) of the n-grams are kept (2 bytes per word stored, before compression). A text
shorter than NGRAM words has no n-gram, hence no fingerprint: a short evaluation item is matched whole
instead (ghostvis_core/data/short_items.py).
"""

from __future__ import annotations

import hashlib
import re

NGRAM = 13  # words per n-gram (GPT-3, Marin)
WINDOW = 8  # n-grams per winnowing window: the guarantee holds for shared runs of NGRAM + WINDOW - 1 words

_WORD = re.compile(r"[^\W_]+")


def normalize(text: str) -> list[str]:
    """The text's words: lowercased runs of letters and digits ("It's 3:45!" -> it, s, 3, 45)."""
    return _WORD.findall(text.lower())


def ngram_hash(words: list[str]) -> int:
    """One n-gram's hash: blake2b-64 of its words joined by single spaces, as a signed int64 (Parquet)."""
    digest = hashlib.blake2b(" ".join(words).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def ngram_hashes(text: str, n: int = NGRAM) -> list[int]:
    """Every n-gram's hash, in text order (empty for a text of fewer than n words)."""
    words = normalize(text)
    return [ngram_hash(words[i : i + n]) for i in range(len(words) - n + 1)]


def winnow(hashes: list[int], window: int = WINDOW) -> set[int]:
    """The smallest hash of every `window` consecutive hashes (the whole list when it is shorter)."""
    if not hashes:
        return set()
    span = min(window, len(hashes))
    return {min(hashes[i : i + span]) for i in range(len(hashes) - span + 1)}


# The raw columns record_text reads, per source kind (the gate reads the consumed rows' text with them).
TEXT_COLUMNS = {
    "text": ["text"],
    "chat": ["messages"],
    "preference": ["prompt", "chosen", "rejected"],
    "problem": ["prompt", "answer"],
    "image_caption": ["caption"],
}


def record_text(kind: str, record: dict) -> str:
    """The words a training record of a source kind is fingerprinted from: the text it is tokenized
    from (a text, a chat's messages, a caption), a preference pair's prompt, chosen and rejected
    replies, or a problem's prompt and answer (each a string or a message list). One rule for
    tokenization (ghostvis_core/data/tokenize_shards.py records these) and the demo
    builders (which drop by them), so what a builder cleared is what the gate sees."""
    if kind == "chat":
        return "\n".join(m["content"] for m in record["messages"] or [])
    if kind in ("preference", "problem"):
        return "\n".join(prompt_text(record[k]) for k in TEXT_COLUMNS[kind])
    return record.get("caption" if kind == "image_caption" else "text") or ""


def prompt_text(value: str | list[dict] | None) -> str:
    """A field that is a string or a message list, as text: the messages' contents, one a line."""
    if isinstance(value, list):
        return "\n".join(m["content"] for m in value)
    return value or ""


def fingerprints(text: str) -> set[int]:
    """The text's winnowed 13-gram hashes: what the ledger stores per training document and what the
    evaluation sets are reduced to, so both sides are sampled by the same rule."""
    return winnow(ngram_hashes(text))

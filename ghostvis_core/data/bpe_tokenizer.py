"""Byte-level BPE tokenizer: trained with HF `tokenizers`, served as a `tiktoken.Encoding`.

HF `tokenizers` trains fast; tiktoken encodes fast and is what the rest of the pipeline uses. A
trained tokenizer is stored as `ranks.tiktoken` (tiktoken's own format) plus `tokenizer.json`, in the
artifact store under kind "tokenizer" and its `tokenizer_id`, a hash of its content: two tokenizers
with the same id encode identically, so the id can name the tokenized shards built with it. A tokenizer
brought as a file (ghostvis_core.data.brought_tokenizer) is stored and named the same way.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import tiktoken
from tokenizers import Regex, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from ghostvis_core.errors import GhostvisError
from ghostvis_core.store import Store

SPECIAL_TOKENS = ("<|bos|>", "<|eot|>", "<|system|>", "<|user|>", "<|assistant|>", "<|image|>", "<|pad|>")
# GPT-4 style, but numbers are split into 1-2 digit groups (as nanochat does) to save vocab on a
# small tokenizer. HF's Oniguruma accepts the possessive quantifiers, so one pattern serves both.
SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
)
RANKS_FILE = "ranks.tiktoken"
META_FILE = "tokenizer.json"

_ENDOFTEXT = "<|endoftext|>"
# The files tiktoken downloads for each standard encoding, with their sha256 (copied from
# tiktoken_ext/openai_public.py): tiktoken uses a cached copy only when its hash matches.
_BLOB = "https://openaipublic.blob.core.windows.net"
_STANDARD_FILES = {
    "gpt2": [
        (f"{_BLOB}/gpt-2/encodings/main/vocab.bpe", "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"),
        (
            f"{_BLOB}/gpt-2/encodings/main/encoder.json",
            "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
        ),
    ],
    "cl100k_base": [
        (f"{_BLOB}/encodings/cl100k_base.tiktoken", "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"),
    ],
    "o200k_base": [
        (f"{_BLOB}/encodings/o200k_base.tiktoken", "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"),
    ],
}


@dataclass(frozen=True)
class Tokenizer:
    """A tiktoken encoding plus the id that names it in the artifact store."""

    enc: tiktoken.Encoding
    tokenizer_id: str
    # GhostVis's special names (SPECIAL_TOKENS) -> what stands for each in a tokenizer brought as a file: one of its
    # own special tokens ("<|eot_id|>"), or for a chat role a text with them ("<|im_start|>user\n"). A name not here
    # is a special token of that name (a trained tokenizer: always).
    markers: Mapping[str, str] = field(default_factory=dict, hash=False)

    @property
    def vocab_size(self) -> int:
        return self.enc.n_vocab

    @property
    def bos(self) -> int:
        """Id of <|bos|>; standard encodings have only <|endoftext|>, which serves as both."""
        return self.special("<|bos|>" if self.tokenizer_id not in _STANDARD_FILES else _ENDOFTEXT)

    @property
    def eot(self) -> int:
        return self.special("<|eot|>" if self.tokenizer_id not in _STANDARD_FILES else _ENDOFTEXT)

    def special(self, name: str) -> int:
        """The one id that stands for GhostVis's special `name` (through `markers`)."""
        text = self.markers.get(name, name)
        if text not in self.enc.special_tokens_set:
            raise GhostvisError(
                f"tokenizer {self.tokenizer_id} has no special token {text} for {name}; it has "
                f"{', '.join(sorted(self.enc.special_tokens_set))}. Use a tokenizer trained by GhostVis "
                f"(the `tokenizer` asset) for chat and vision stages, or map {name} onto one of these "
                f"(the asset's special_tokens)"
            )
        return self.enc.encode_single_token(text)

    def has(self, name: str) -> bool:
        """Whether something stands for GhostVis's special `name` (a standard encoding has no chat roles)."""
        return name in self.markers or name in self.enc.special_tokens_set

    def marker(self, name: str) -> list[int]:
        """The ids that stand for GhostVis's special `name`: a chat role may be several (`markers`)."""
        if name not in self.markers:
            return [self.special(name)]
        return self.enc.encode(self.markers[name], allowed_special="all")

    def same_ids(self, other: Tokenizer) -> bool:
        """Whether both encode every text to the same ids (ranks, split and special tokens alike): they may
        differ only in `markers`, what the chat template renders with."""
        a, b = self.enc, other.enc
        return (a._pat_str, a._special_tokens, a._mergeable_ranks) == (
            b._pat_str,
            b._special_tokens,
            b._mergeable_ranks,
        )

    def encode(self, text: str) -> list[int]:
        """Ordinary text: a literal "<|bos|>" in a document is encoded as text, never as the special."""
        return self.enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        return self.enc.encode_ordinary_batch(texts, num_threads=num_threads)

    def decode(self, ids: Sequence[int]) -> str:
        return self.enc.decode(ids.tolist() if hasattr(ids, "tolist") else list(ids))


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE of `vocab_size` tokens in total (the specials included)."""
    n_ranks = vocab_size - len(SPECIAL_TOKENS)
    if n_ranks < 256:
        raise GhostvisError(
            f"tokenizer vocab_size {vocab_size} is too small: a byte-level BPE needs 256 byte tokens "
            f"plus {len(SPECIAL_TOKENS)} specials; use at least {256 + len(SPECIAL_TOKENS)}"
        )
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=n_ranks,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer=trainer)
    merges = json.loads(hf.to_str())["model"]["merges"]
    return build_tokenizer(_merges_to_ranks(merges), SPLIT_PATTERN)


def save_tokenizer(tok: Tokenizer, store: Store) -> Path:
    """Write artifact (tokenizer, tokenizer_id) atomically; an existing one with that id is already it.
    Returns this node's copy of its folder."""
    if tok.tokenizer_id in _STANDARD_FILES:
        raise GhostvisError(f"{tok.tokenizer_id} is a standard tiktoken encoding: load it by name, do not save it")
    if store.exists("tokenizer", tok.tokenizer_id):
        return store.fetch("tokenizer", tok.tokenizer_id)
    target = store.writable("tokenizer", tok.tokenizer_id)
    root = target.parent
    # tiktoken keeps what we need only in these attributes; they have been stable since 0.1.
    ranks_bytes = _ranks_file_bytes(tok.enc._mergeable_ranks)
    meta = {
        "tokenizer_id": tok.tokenizer_id,
        "pattern": tok.enc._pat_str,
        "special_tokens": dict(sorted(tok.enc._special_tokens.items(), key=lambda kv: kv[1])),
        "vocab_size": tok.vocab_size,
        "ranks_sha256": hashlib.sha256(ranks_bytes).hexdigest(),
    }
    if tok.markers:
        meta["markers"] = dict(tok.markers)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{tok.tokenizer_id}.tmp-", dir=root))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the store is shared
        (tmp / RANKS_FILE).write_bytes(ranks_bytes)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        os.rename(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not target.is_dir():  # not merely a concurrent writer finishing first
            raise
    store.publish("tokenizer", tok.tokenizer_id)
    return target


def newest_tokenizer(store: Store) -> str:
    """The id of the tokenizer added to the store last."""
    found = store.keys("tokenizer")
    if not found:
        raise GhostvisError(
            f"no tokenizer in the store {store.uri}; materialize the `tokenizer` asset first (or run `ghostvis demo`)"
        )
    return found[-1][0]


def load_tokenizer(ref: str | Path, store: Store | None = None) -> Tokenizer:
    """Load by tokenizer_id from the store, by directory path, or by standard tiktoken encoding name."""
    ref = str(ref)
    if ref in _STANDARD_FILES:
        return _load_standard(ref)
    named = store is not None and bool(ref) and "/" not in ref and not ref.startswith(".")  # may be an id
    directory = store.fetch("tokenizer", ref) if named and store.exists("tokenizer", ref) else Path(ref)
    if not directory.is_dir():
        where = f" in the store ({store.uri_of('tokenizer', ref)})" if named else ""
        raise GhostvisError(
            f"tokenizer {ref!r} not found{where}: give a tokenizer_id of a materialized `tokenizer` asset, "
            f"a tokenizer directory, or one of {', '.join(_STANDARD_FILES)}"
        )
    return _load_directory(directory)


# --- internals --------------------------------------------------------------------------------


def _merges_to_ranks(merges: list) -> dict[bytes, int]:
    """tiktoken ranks: the 256 bytes in byte order, then each merged token in merge order."""
    byte_of = {ch: b for b, ch in bytes_to_unicode().items()}
    ranks = {bytes([b]): b for b in range(256)}
    for merge in merges:
        left, right = merge.split(" ") if isinstance(merge, str) else merge  # old and new HF formats
        a, b = (bytes(byte_of[ch] for ch in part) for part in (left, right))
        if a not in ranks or b not in ranks:
            raise RuntimeError(f"BPE training produced merge {merge!r} whose parts have no rank yet")
        # HF may list a second merge that builds an existing token; tiktoken knows it by its first.
        ranks.setdefault(a + b, len(ranks))
    return ranks


def bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte-to-printable-character map that HF's ByteLevel pre-tokenizer uses."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, n = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + n)
            n += 1
    return mapping


def _ranks_file_bytes(ranks: dict[bytes, int]) -> bytes:
    """tiktoken's "base64(token) rank" lines, readable by tiktoken.load.load_tiktoken_bpe."""
    return b"".join(
        base64.b64encode(token) + b" " + str(rank).encode() + b"\n"
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1])
    )


def build_tokenizer(
    ranks: dict[bytes, int],
    pattern: str,
    specials: dict[str, int] | None = None,
    markers: Mapping[str, str] | None = None,
) -> Tokenizer:
    """A Tokenizer named by a hash of its content; the specials default to SPECIAL_TOKENS after the
    ranks (a tokenizer brought as a file brings its own and `markers`, ghostvis_core.data.brought_tokenizer)."""
    specials = specials or {name: len(ranks) + i for i, name in enumerate(SPECIAL_TOKENS)}
    digest = hashlib.sha256(_ranks_file_bytes(ranks))
    digest.update(pattern.encode())
    digest.update(json.dumps(specials).encode())
    if markers:  # none for a trained tokenizer, whose ids stay as they were
        digest.update(json.dumps(dict(sorted(markers.items()))).encode())
    tokenizer_id = f"bpe{len(ranks) + len(specials)}-{digest.hexdigest()[:12]}"
    enc = tiktoken.Encoding(tokenizer_id, pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)
    return Tokenizer(enc=enc, tokenizer_id=tokenizer_id, markers=dict(markers or {}))


def _load_directory(directory: Path) -> Tokenizer:
    fix = f"delete {directory} and re-materialize the `tokenizer` asset"
    try:
        meta = json.loads((directory / META_FILE).read_text())
        ranks_bytes = (directory / RANKS_FILE).read_bytes()
        expected_sha256, pattern = meta["ranks_sha256"], meta["pattern"]
    except (OSError, ValueError, KeyError) as e:
        what = getattr(e, "filename", None) or directory / META_FILE
        raise GhostvisError(f"tokenizer {directory}: cannot read {what} ({e!r}); {fix}") from e
    if hashlib.sha256(ranks_bytes).hexdigest() != expected_sha256:
        raise GhostvisError(
            f"tokenizer {directory}: {directory / RANKS_FILE} does not match the sha256 recorded in "
            f"{META_FILE} (modified or partly written); {fix}"
        )
    tok = build_tokenizer(parse_ranks(ranks_bytes), pattern, meta.get("special_tokens"), meta.get("markers"))
    if tok.tokenizer_id != meta.get("tokenizer_id"):
        raise GhostvisError(
            f"tokenizer {directory}: {META_FILE} says id {meta.get('tokenizer_id')} but its content hashes "
            f"to {tok.tokenizer_id}; {fix}"
        )
    return tok


def parse_ranks(data: bytes) -> dict[bytes, int]:
    """A tiktoken BPE file's "base64(token) rank" lines. Parsed here rather than with
    tiktoken.load.load_tiktoken_bpe, which would copy the file into tiktoken's download cache."""
    return {
        base64.b64decode(token, validate=True): int(rank)
        for token, rank in (line.split() for line in data.splitlines() if line)
    }


def _load_standard(name: str) -> Tokenizer:
    """Load a standard tiktoken encoding only from tiktoken's cache: never start a download."""
    if "TIKTOKEN_CACHE_DIR" in os.environ:
        cache_dir = os.environ["TIKTOKEN_CACHE_DIR"]
    elif "DATA_GYM_CACHE_DIR" in os.environ:
        cache_dir = os.environ["DATA_GYM_CACHE_DIR"]
    else:
        cache_dir = os.path.join(tempfile.gettempdir(), "data-gym-cache")
    fix = (
        f"GhostVis never downloads: load {name} with tiktoken once on a machine with internet and copy its "
        f"cache here, or use a trained tokenizer (materialize the `tokenizer` asset)"
    )
    if not cache_dir:
        raise GhostvisError(f"tokenizer {name}: TIKTOKEN_CACHE_DIR is empty, which disables tiktoken's cache; {fix}")
    for url, sha256 in _STANDARD_FILES[name]:
        path = Path(cache_dir) / hashlib.sha1(url.encode()).hexdigest()
        if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != sha256:
            raise GhostvisError(
                f"tokenizer {name}: tiktoken cache file {path} (a copy of {url}) is missing or incomplete; {fix}"
            )
    return Tokenizer(enc=tiktoken.get_encoding(name), tokenizer_id=name)

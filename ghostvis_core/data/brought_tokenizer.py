"""A tokenizer brought as a file instead of trained: a Hugging Face byte-level BPE `tokenizer.json`
(GPT-2, Llama 3, Qwen2 style) or a tiktoken BPE file, served through tiktoken like a trained one.

tiktoken merges the adjacent pair whose concatenation has the lowest rank; a byte-level BPE whose
merges follow its vocabulary's order picks the same pairs, so the file's vocabulary becomes tiktoken's
ranks and every text encodes to the same ids (checked on a sample when the file is read; a file
where it would not is refused). A normalizer other than NFC changes the text before it is split and is
refused; NFC is accepted: GhostVis encodes the text as it is, which is the same on NFC text (nearly all).

GhostVis's chat template needs a BOS, an EOT and a marker per role (`chat.render_chat`). A file with
GhostVis's own names (a GhostVis export) needs no mapping; ChatML (<|im_start|>) and Llama 3
(<|start_header_id|>) files are recognised; the asset's `special_tokens` maps or overrides any of them.
<|image|> and <|pad|> are added after the file's ids when it has none (a pad is never trained and an
image token is replaced by the image's latents). A tiktoken BPE file has no special tokens: GhostVis's
own are added after its ranks, as for a trained tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from ghostvis_core.data.bpe_tokenizer import SPECIAL_TOKENS, Tokenizer, build_tokenizer, bytes_to_unicode, parse_ranks
from ghostvis_core.data.chat import ROLES
from ghostvis_core.data.shard_manifest import fetch_file
from ghostvis_core.errors import GhostvisError

# GPT-2's split, what a ByteLevel pre-tokenizer with use_regex=true applies.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# cl100k_base's split, which Llama 3 uses too: the default for a tiktoken BPE file, which holds no pattern.
CL100K_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
# What the chat template cannot do without; <|image|> and <|pad|> are added when a file has neither.
ROLE_NAMES = tuple(f"<|{role}|>" for role in ROLES)
REQUIRED = ("<|bos|>", "<|eot|>", *ROLE_NAMES)
ADDED = ("<|image|>", "<|pad|>")
# Chat formats recognised by the special tokens a file has: GhostVis's name -> the file's text for it.
FAMILIES = {
    "ChatML": (
        ("<|im_start|>", "<|im_end|>"),
        {
            "<|bos|>": "<|endoftext|>",
            "<|eot|>": "<|im_end|>",
            **{name: f"<|im_start|>{name[2:-2]}\n" for name in ROLE_NAMES},
        },
    ),
    "Llama 3": (
        ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        {
            "<|bos|>": "<|begin_of_text|>",
            "<|eot|>": "<|eot_id|>",
            **{name: f"<|start_header_id|>{name[2:-2]}<|end_header_id|>\n\n" for name in ROLE_NAMES},
        },
    ),
}
_SPECIAL_LOOKING = re.compile(r"<\|[^|<>]*\|>|<[a-z_]+>")


@dataclass(frozen=True)
class BroughtTokenizer:
    tokenizer: Tokenizer
    sha256: str  # of the file as given


def bring_tokenizer(
    uri: str, special_tokens: Mapping[str, str] | None = None, pattern: str = "", vocab_size: int | None = None
) -> BroughtTokenizer:
    """The tokenizer in the file at `uri` (a path, file://, s3://, http(s)://, or hf://org/name[@revision] for
    that repository's tokenizer.json), with the file's sha256. `special_tokens`: GhostVis role (bos, eot, system,
    user, assistant, image, pad) -> the file's text for it; `pattern`: a tiktoken BPE file's split regex
    (default cl100k's); `vocab_size`: the rows of the model it is for, which the added specials must fit."""
    with _local_file(uri) as path:
        data = path.read_bytes()
    return BroughtTokenizer(
        read_tokenizer_file(uri, data, special_tokens, pattern, vocab_size), hashlib.sha256(data).hexdigest()
    )


def read_tokenizer_file(
    name: str,
    data: bytes,
    special_tokens: Mapping[str, str] | None = None,
    pattern: str = "",
    vocab_size: int | None = None,
) -> Tokenizer:
    """A Tokenizer from a tokenizer.json (JSON) or a tiktoken BPE file ("base64 rank" lines), `data` being
    the content of the file `name` (as the user gave it); refused, naming the file, what it holds and the fix,
    when GhostVis cannot serve it exactly."""
    where = f"tokenizer file {name}"
    if data.lstrip().startswith(b"{"):
        if pattern:
            raise GhostvisError(f"{where}: a tokenizer.json has its own split pattern; leave `pattern` empty")
        return _from_hf_json(data, where, dict(special_tokens or {}), vocab_size)
    try:
        ranks = parse_ranks(data)
    except ValueError:
        raise GhostvisError(
            f"{where}: neither a tokenizer.json (JSON) nor a tiktoken BPE file ('base64 rank' lines); give a "
            "Hugging Face tokenizer.json or a .tiktoken file"
        ) from None
    if special_tokens:
        raise GhostvisError(
            f"{where}: a tiktoken BPE file has no special tokens to map special_tokens onto; GhostVis adds its "
            "own after the ranks: leave special_tokens empty"
        )
    if sorted(ranks.values()) != list(range(len(ranks))) or any(ranks.get(bytes([b])) is None for b in range(256)):
        raise GhostvisError(
            f"{where}: its ranks are not 0..{len(ranks) - 1} with every single byte ranked; it is not a "
            "byte-level BPE tiktoken file"
        )
    return _fit(build_tokenizer(ranks, pattern or CL100K_PATTERN), where, vocab_size)


def chat_markers(file_specials: set[str], overrides: Mapping[str, str], where: str) -> dict[str, str]:
    """GhostVis's special names -> the file's text for each (only where they differ): the file's own name, else
    its chat format's (FAMILIES), else the user's override; refused when a REQUIRED one has none."""
    known = {"<|" + k.strip("<|>") + "|>": v for k, v in overrides.items()}
    unknown = sorted(set(known) - set(SPECIAL_TOKENS))
    if unknown:
        raise GhostvisError(
            f"{where}: special_tokens names {', '.join(unknown)}; GhostVis maps only "
            f"{', '.join(n[2:-2] for n in SPECIAL_TOKENS)}"
        )
    markers = {}
    for needs, texts in FAMILIES.values():
        if set(needs) <= file_specials:  # its texts for what the file has (ChatML without <|endoftext|>: no BOS)
            markers = {
                name: text
                for name, text in texts.items()
                if name not in file_specials and set(_SPECIAL_LOOKING.findall(text)) <= file_specials
            }
            break
    markers.update(known)
    for name, text in markers.items():
        strange = [t for t in _SPECIAL_LOOKING.findall(text) if t not in file_specials]
        if strange:
            raise GhostvisError(
                f"{where}: {name} is mapped to {text!r}, but {', '.join(strange)} is not one of its special tokens "
                f"({_listing(file_specials)}); fix the mapping (special_tokens)"
            )
        if name not in ROLE_NAMES and text not in file_specials:
            raise GhostvisError(
                f"{where}: {name} is mapped to {text!r}, which is not one special token; map it to one of "
                f"{_listing(file_specials)}"
            )
    missing = [n for n in REQUIRED if n not in markers and n not in file_specials]
    if missing:
        raise GhostvisError(
            f"{where}: it has no token for GhostVis's {', '.join(missing)} (its special tokens: "
            f"{_listing(file_specials)}) and is not {' or '.join(FAMILIES)}; map each onto the file's own with the "
            'tokenizer asset\'s special_tokens, e.g. {"bos": "<s>", "eot": "</s>", "user": "<|user_start|>"}, '
            "or bring a tokenizer with chat tokens"
        )
    return {name: text for name, text in markers.items() if text != name}


# --- internals --------------------------------------------------------------------------------


def _from_hf_json(data: bytes, where: str, overrides: dict[str, str], vocab_size: int | None) -> Tokenizer:
    try:
        spec = json.loads(data)
    except ValueError as exc:
        raise GhostvisError(f"{where}: not valid JSON ({exc}); give the tokenizer.json as saved") from None
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise GhostvisError(
            f"{where}: model type {model.get('type')} (SentencePiece/Unigram or WordPiece) is not byte-level BPE; "
            "GhostVis serves byte-level BPE tokenizers (GPT-2, Llama 3, Qwen2 style) through tiktoken: bring "
            "one of those or let the `tokenizer` asset train one"
        )
    normalizer = (spec.get("normalizer") or {}).get("type")
    if normalizer not in (None, "NFC"):
        raise GhostvisError(
            f"{where}: normalizer {normalizer} changes the text before it is split, which tiktoken does not; "
            "GhostVis serves byte-level BPE tokenizers without one (or NFC): bring one of those"
        )
    pattern = _split_pattern(spec.get("pre_tokenizer"), where)
    char_byte = {c: b for b, c in bytes_to_unicode().items()}
    added = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    try:
        ranks = {bytes(char_byte[c] for c in text): i for text, i in model["vocab"].items() if text not in added}
    except KeyError as exc:
        raise GhostvisError(
            f"{where}: vocab entry with character {exc} is not byte-level BPE (SentencePiece-style BPE, as in "
            "Llama 2 or Mistral, is not served); bring a byte-level BPE tokenizer"
        ) from None
    markers = chat_markers(set(added), overrides, where)
    specials, top = dict(added), max([*ranks.values(), *added.values()]) + 1
    for name in ADDED:
        if name not in specials and name not in markers:
            specials[name], top = top, top + 1
    tok = build_tokenizer(ranks, pattern, dict(sorted(specials.items(), key=lambda kv: kv[1])), markers)
    _check_same_ids(
        tok, HFTokenizer.from_str(data.decode()), [t for t in model["vocab"] if t not in added][:4000], where
    )
    return _fit(tok, where, vocab_size)


def _fit(tok: Tokenizer, where: str, vocab_size: int | None) -> Tokenizer:
    if vocab_size is not None and tok.vocab_size > vocab_size:
        raise GhostvisError(
            f"{where}: with the special tokens GhostVis adds ({', '.join(ADDED)} where it has none) its ids go up "
            f"to {tok.vocab_size - 1} but the model has vocab_size {vocab_size}; map image and pad onto tokens it "
            "has (special_tokens) or use a model with room"
        )
    return tok


def _listing(names: set[str]) -> str:
    shown = sorted(names)
    return ", ".join(shown[:12]) + (f" and {len(shown) - 12} more" if len(shown) > 12 else "") if shown else "none"


def _split_pattern(pre: dict | None, where: str) -> str:
    """The regex of a Split(+ByteLevel) pre-tokenizer, or GPT-2's for a ByteLevel that splits itself."""
    steps = (pre or {}).get("pretokenizers") or ([pre] if pre else [])
    splits = [s["pattern"]["Regex"] for s in steps if s.get("type") == "Split" and "Regex" in s.get("pattern", {})]
    byte_level = [s for s in steps if s.get("type") == "ByteLevel"]
    if len(splits) == 1 and byte_level and not byte_level[0].get("use_regex", True):
        return splits[0]
    if not splits and byte_level and byte_level[0].get("use_regex", True):
        return GPT2_PATTERN
    raise GhostvisError(
        f"{where}: pre_tokenizer {json.dumps(pre)[:200]} is not a byte-level Split + ByteLevel "
        "sequence; GhostVis serves byte-level BPE tokenizers only"
    )


def _check_same_ids(tok: Tokenizer, hf: HFTokenizer, vocab_texts: list[str], where: str) -> None:
    """Encode a sample (prose, code, digits, the vocabulary's own pieces) both ways; any difference refuses."""
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    pieces = bytes(b for t in vocab_texts for b in (byte_of.get(c, 32) for c in t)).decode("utf-8", "replace")
    sample = "The quick brown fox, 12345 times: def f(x):\n\treturn x**2  # ok?\nÜber naïve café — ✓ 日本語. " + pieces
    ours, theirs = tok.encode(sample), hf.encode(sample, add_special_tokens=False).ids
    if ours != theirs:
        at = next(i for i, (a, b) in enumerate(zip(ours + [-1], theirs + [-1])) if a != b)
        raise GhostvisError(
            f"{where}: its BPE merges are not in rank order, so tiktoken would encode differently "
            f"(first difference at token {at}: {ours[at : at + 3]} vs {theirs[at : at + 3]}); GhostVis "
            "cannot train on it exactly"
        )


@contextmanager
def _local_file(uri: str) -> Iterator[Path]:
    """A local path as it is; anything else downloaded (by data.sources, retried) into a temporary folder."""
    if uri.startswith("hf://"):
        repo, _, revision = uri.removeprefix("hf://").partition("@")
        endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
        url = f"{endpoint}/{repo}/resolve/{revision or 'main'}/tokenizer.json"
    elif uri.startswith(("s3://", "http://", "https://")):
        url = uri
    else:
        path = Path(uri.removeprefix("file://")).expanduser()
        if not path.is_file():
            raise GhostvisError(
                f"tokenizer file {uri}: no such file; give a tokenizer.json or .tiktoken file (a path, file://, "
                "s3://, http(s):// or hf://org/name@revision)"
            )
        yield path
        return
    folder = Path(tempfile.mkdtemp(prefix="ghostvis-tokenizer-"))
    try:
        fix = "check the URL, the network and the credentials (AWS variables, HF_TOKEN)"
        yield fetch_file("tokenizer file", url, folder / Path(url).name, fix).path
    finally:
        shutil.rmtree(folder, ignore_errors=True)

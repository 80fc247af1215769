"""GhostVis's tiktoken tokenizer <-> a Hugging Face `tokenizer.json` (byte-level BPE, same ids).

tiktoken merges the adjacent pair whose concatenation has the lowest rank; an HF BPE whose merges
are every split of each token into two ranked tokens, ordered by the token's rank (the conversion
transformers' TikTokenConverter does), with `ignore_merges` (a whole ranked piece is one token, as
in tiktoken), picks the same pairs, so both encode every text to the same ids.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from ghostvis_core.data.chat import ROLES
from ghostvis_core.data.tokenizer import SPECIAL_TOKENS, Tokenizer, build_tokenizer, bytes_to_unicode
from ghostvis_core.errors import GhostvisError

CHAT_SPECIALS = ("<|bos|>", "<|eot|>", "<|system|>", "<|user|>", "<|assistant|>")
# GPT-2's split, what a ByteLevel pre-tokenizer with use_regex=true applies.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# render_chat / render_prompt (ghostvis_core.data.chat) as a Jinja template, token for token.
CHAT_TEMPLATE = (
    "{{- '<|bos|>' -}}"
    "{%- for m in messages -%}"
    "{%- if m['role'] not in " + json.dumps(list(ROLES)) + " -%}"
    "{{- raise_exception('chat message role ' ~ m['role'] ~ ' is not one of " + ", ".join(ROLES) + "') -}}"
    "{%- endif -%}"
    "{{- '<|' ~ m['role'] ~ '|>' ~ (m['content'] or '') ~ '<|eot|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)


def _as_text(token: bytes, byte_char: dict[int, str]) -> str:
    return "".join(byte_char[b] for b in token)


def to_hf_tokenizer(tok: Tokenizer) -> HFTokenizer:
    """The tiktoken encoding as an HF `tokenizers.Tokenizer`: vocab = ranks, merges derived from them,
    GhostVis's split pattern, the specials as added tokens; one <|bos|> is prepended to a single text
    (as every GhostVis document starts), never in apply_chat_template (it renders its own)."""
    ranks: dict[bytes, int] = tok.enc._mergeable_ranks
    byte_char = bytes_to_unicode()
    merges = []
    for token, rank in ranks.items():
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        merges += [(rank, ranks[a], ranks[b], a, b) for a, b in splits]
    merges.sort()
    vocab = {_as_text(t, byte_char): r for t, r in ranks.items()}
    hf = HFTokenizer(
        models.BPE(
            vocab,
            [(_as_text(a, byte_char), _as_text(b, byte_char)) for *_, a, b in merges],
            fuse_unk=False,
            ignore_merges=True,
        )
    )
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(tok.enc._pat_str), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    hf.decoder = decoders.ByteLevel()
    specials = sorted(tok.enc._special_tokens.items(), key=lambda kv: kv[1])
    hf.add_special_tokens([AddedToken(name, special=True, normalized=False) for name, _ in specials])
    got = {name: hf.token_to_id(name) for name, _ in specials}
    if got != dict(specials):
        raise GhostvisError(
            f"tokenizer {tok.tokenizer_id}: special token ids {dict(specials)} are not contiguous after "
            f"the ranks (HF would give {got}); it cannot be written as a tokenizer.json"
        )
    bos = tok.bos
    hf.post_processor = processors.TemplateProcessing(
        single=f"{tok.enc.decode([bos])} $A",
        pair=f"{tok.enc.decode([bos])} $A $B",
        special_tokens=[(tok.enc.decode([bos]), bos)],
    )
    return hf


def save_hf_tokenizer(tok: Tokenizer, out_dir: Path, max_len: int) -> None:
    """tokenizer.json + tokenizer_config.json (with the chat template when the tokenizer has GhostVis's
    chat specials), written by transformers' PreTrainedTokenizerFast."""
    from transformers import PreTrainedTokenizerFast

    specials = tok.enc.special_tokens_set
    fast = PreTrainedTokenizerFast(
        tokenizer_object=to_hf_tokenizer(tok),
        bos_token=tok.enc.decode([tok.bos]),
        eos_token=tok.enc.decode([tok.eot]),
        pad_token="<|pad|>" if "<|pad|>" in specials else None,
        model_max_length=max_len,
        clean_up_tokenization_spaces=False,
    )
    if set(CHAT_SPECIALS) <= specials:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir), save_jinja_files=False)


def from_hf_tokenizer(path: Path, vocab_size: int) -> Tokenizer:
    """A GhostVis Tokenizer from an HF byte-level BPE tokenizer.json: its ranks, split pattern and
    special tokens; GhostVis's own specials it lacks are appended after its highest id (they must fit
    the model's `vocab_size` rows). Refused when tiktoken would not encode exactly as HF does."""
    where = f"tokenizer {path}"
    try:
        spec = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise GhostvisError(
            f"{where}: cannot read it ({exc}); the checkpoint folder needs its tokenizer.json"
        ) from None
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise GhostvisError(
            f"{where}: model type {model.get('type')} is not supported; GhostVis imports byte-level "
            "BPE tokenizers (Llama 3, Qwen2, GPT-2 style)"
        )
    pattern = _split_pattern(spec.get("pre_tokenizer"), where)
    char_byte = {c: b for b, c in bytes_to_unicode().items()}
    added = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    try:
        ranks = {bytes(char_byte[c] for c in text): i for text, i in model["vocab"].items() if text not in added}
    except KeyError as exc:
        raise GhostvisError(f"{where}: vocab entry with character {exc} is not byte-level BPE") from None
    specials = dict(added)
    top = max([*ranks.values(), *specials.values()]) + 1
    for name in SPECIAL_TOKENS:
        if name not in specials:
            specials[name], top = top, top + 1
    if top > vocab_size:
        raise GhostvisError(
            f"{where}: {top - len(added) - len(ranks)} GhostVis special tokens "
            f"({', '.join(n for n in SPECIAL_TOKENS if n not in added)}) need ids up to {top - 1} but the "
            f"model has vocab_size {vocab_size}; use a tokenizer that has them or a model with room"
        )
    tok = build_tokenizer(ranks, pattern, dict(sorted(specials.items(), key=lambda kv: kv[1])))
    _check_same_ids(
        tok, HFTokenizer.from_str(json.dumps(spec)), [t for t in model["vocab"] if t not in added][:4000], where
    )
    return tok


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
        "sequence; GhostVis imports byte-level BPE tokenizers only"
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

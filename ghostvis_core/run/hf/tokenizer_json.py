"""GhostVis's tiktoken tokenizer as a Hugging Face `tokenizer.json` (byte-level BPE, same ids); the other
way, a tokenizer.json brought to GhostVis, is ghostvis_core.data.brought_tokenizer.

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

from ghostvis_core.data.bpe_tokenizer import Tokenizer, bytes_to_unicode
from ghostvis_core.data.chat import ROLES
from ghostvis_core.errors import GhostvisError


def chat_template(tok: Tokenizer) -> str:
    """render_chat / render_prompt (ghostvis_core.data.chat) as a Jinja template, token for token, with
    the tokenizer's own text for each marker (`Tokenizer.markers`)."""

    def text(name: str) -> str:
        return json.dumps(tok.markers.get(name, name))

    roles = "{" + ", ".join(f"{json.dumps(r)}: {text(f'<|{r}|>')}" for r in ROLES) + "}"
    return (
        "{{- " + text("<|bos|>") + " -}}"
        "{%- set markers = " + roles + " -%}"
        "{%- for m in messages -%}"
        "{%- if m['role'] not in markers -%}"
        "{{- raise_exception('chat message role ' ~ m['role'] ~ ' is not one of " + ", ".join(ROLES) + "') -}}"
        "{%- endif -%}"
        "{{- markers[m['role']] ~ (m['content'] or '') ~ " + text("<|eot|>") + " -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- markers['assistant'] -}}{%- endif -%}"
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
    """tokenizer.json + tokenizer_config.json (with the chat template when the tokenizer has a marker for
    each chat role), written by transformers' PreTrainedTokenizerFast."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=to_hf_tokenizer(tok),
        bos_token=tok.enc.decode([tok.bos]),
        eos_token=tok.enc.decode([tok.eot]),
        pad_token=tok.enc.decode([tok.special("<|pad|>")]) if tok.has("<|pad|>") else None,
        model_max_length=max_len,
        clean_up_tokenization_spaces=False,
    )
    if all(tok.has(f"<|{r}|>") for r in ROLES):
        fast.chat_template = chat_template(tok)
    fast.save_pretrained(str(out_dir), save_jinja_files=False)

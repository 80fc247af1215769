"""The chat template, shared by SFT tokenization, DPO pairs, evaluation and `ghostvis chat`:

    <|bos|><|system|>...<|eot|><|user|>...<|eot|><|assistant|>...<|eot|>...

Loss falls on assistant content and the <|eot|> that closes an assistant turn (so the model learns
to stop), never on the role markers or user/system turns. A tokenizer brought as a file renders each
marker as its own tokens (`Tokenizer.markers`: "<|im_start|>user\n" for <|user|> in ChatML). A literal
`<|image|>` in a message is the image placeholder; every other special-token string in content is
encoded as plain text.
"""

from __future__ import annotations

import numpy as np

from ghostvis_core.data.bpe_tokenizer import Tokenizer
from ghostvis_core.errors import GhostvisError

ROLES = ("system", "user", "assistant")
IMAGE = "<|image|>"


def encode_content(tok: Tokenizer, text: str) -> list[int]:
    parts = text.split(IMAGE)
    ids: list[int] = []
    for i, part in enumerate(parts):
        if i:
            ids.append(tok.special(IMAGE))
        if part:
            ids.extend(tok.encode(part))
    return ids


def render_chat(tok: Tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids and a 0/1 loss mask of the same length for a whole conversation."""
    ids, mask = [tok.bos], [0]
    for m in messages:
        role = m.get("role")
        if role not in ROLES:
            raise GhostvisError(f"chat message role {role!r} is not one of {', '.join(ROLES)}")
        trained = int(role == "assistant")
        content = encode_content(tok, m.get("content") or "")
        marker = tok.marker(f"<|{role}|>")
        ids += [*marker, *content, tok.eot]
        mask += [0] * len(marker) + [trained] * len(content) + [trained]
    return ids, mask


def render_prompt(tok: Tokenizer, messages: list[dict]) -> list[int]:
    """The conversation so far, ending with the assistant marker the model continues from."""
    ids, _ = render_chat(tok, messages)
    return ids + tok.marker("<|assistant|>")


def render_reply(tok: Tokenizer, text: str) -> list[int]:
    return encode_content(tok, text) + [tok.eot]


def as_messages(prompt: str | list[dict]) -> list[dict]:
    """A prompt as a source gives it: a message list, or a string, which is one user turn."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt


def render_replies(tok: Tokenizer, reply: str | list[dict]) -> list[int]:
    """A reply as a source gives it, after render_prompt's assistant marker: a string, or (TRL's
    conversational shape) the messages that follow the prompt, the first an assistant turn whose content
    continues the marker and any later turn rendered with its own role marker."""
    if isinstance(reply, str):
        return render_reply(tok, reply)
    ids, _ = render_chat(tok, reply)
    return ids[1 + len(tok.marker("<|assistant|>")) :]  # <|bos|>, the first turn's marker: render_prompt's end


def marker_starts(ids: np.ndarray, marker: list[int]) -> list[int]:
    """Where in `ids` the role marker `marker` (Tokenizer.marker: one id, or several) starts."""
    n = len(marker)
    return [int(i) for i in np.flatnonzero(ids == marker[0]) if np.array_equal(ids[i : i + n], marker)]

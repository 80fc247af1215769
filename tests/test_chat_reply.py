"""`ghostvis chat` ends a reply at the turn's end: <|eot|>, an end of text or the next turn's marker, and
never prints a special token."""

from __future__ import annotations

from ghostvis_core.data.bpe_tokenizer import SPECIAL_TOKENS, train_tokenizer
from ghostvis_pipeline.chat_command import reply_text, special_ids

TEXTS = ["Hello Ada, two and three make five.", "The answer is five.", "Say hello to the tall larch."] * 4


def test_every_special_token_ends_a_reply_and_none_is_printed():
    tok = train_tokenizer(TEXTS, 300)
    ends = special_ids(tok)
    assert sorted(ends) == sorted(tok.special(name) for name in SPECIAL_TOKENS)
    words = tok.encode("Hello Ada.")
    after = tok.encode(" And more words")
    for name in ("<|eot|>", "<|bos|>", "<|user|>", "<|assistant|>"):
        assert reply_text(tok, [*words, tok.special(name), *after]) == "Hello Ada."
    assert reply_text(tok, words) == "Hello Ada."  # the token limit reached: the whole reply
    assert reply_text(tok, [tok.eot]) == ""

"""Build-time decontamination of the embedded demo data: invariant 9 kept at the source, not only
checked by the gate.

The gate (`no_eval_contamination`, ghostvis_core/verify/audit/contamination.py) fails a stage that consumed a
training document sharing more than `contamination.max_overlap` of its 13-gram fingerprints with an
evaluation item, or holding a short evaluation item whole. The demo builders use a stricter rule, as
real pipelines do when they decontaminate: after the train/validation split, a training document that
shares *any* fingerprint (ghostvis_core/data/ngrams.py) with held-out text, or holds a shipped
evaluation item of fewer than 13 words whole (ghostvis_core/data/short_items.py: the gate's rule), is
dropped. For generated data that is right: a templated row sharing one 13-word run with a held-out row
is a near copy of it, a row saying "The capital of France is Paris." is the capitals item itself, and
losing either costs nothing but a regeneration. Held-out text is the validation documents of every
source the builder makes, whatever their kind (the gate compares across kinds), plus the evaluation
items GhostVis ships (ghostvis_core/data/eval_texts.py); through the winnowing guarantee, no demo
training document then repeats 20 consecutive words of any of them. The two builders (stdlib text,
generated tasks) are not checked against each other, which would cost the task build a read of the
stdlib: their texts share no 13-word run at all, and tests/test_demo_corpus.py holds them to that.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import TypeVar

from ghostvis_core.data.eval_texts import shipped_texts
from ghostvis_core.data.ngrams import fingerprints
from ghostvis_core.data.short_items import WholeItems, whole_phrase

T = TypeVar("T")


@dataclass(frozen=True)
class HeldOut:
    """What a training document must not hold: any of `fps`, or any of `whole`'s short items."""

    fps: frozenset[int]
    whole: WholeItems

    def clear(self, text: str) -> bool:
        return self.fps.isdisjoint(fingerprints(text)) and not self.whole.found_in(text)


@cache
def shipped_held_out() -> HeldOut:
    """The shipped evaluation items' fingerprints and short phrases (computed once per process: every
    build needs them)."""
    texts = shipped_texts()
    return HeldOut(
        frozenset(h for text in texts for h in fingerprints(text)),
        WholeItems(p for p in map(whole_phrase, texts) if p),
    )


def held_out(texts: Iterable[str]) -> HeldOut:
    """What a training document must not hold: the fingerprints of `texts` (validation documents) and
    the shipped evaluation items, fingerprinted or, when short, whole."""
    shipped = shipped_held_out()
    fps = set(shipped.fps)
    for text in texts:
        fps |= fingerprints(text)
    return HeldOut(frozenset(fps), shipped.whole)


def drop_shared(train: Sequence[T], text_of: Callable[[T], str], held: HeldOut) -> list[T]:
    """The training documents, in order, that hold nothing of `held`."""
    return [doc for doc in train if held.clear(text_of(doc))]

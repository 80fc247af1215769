"""Build-time decontamination of the embedded demo data: invariant 9 kept at the source, not only
checked by the gate.

The gate (`no_eval_contamination`, ghostvis_core/verify/audit/contamination.py) fails a stage that consumed a
training document sharing more than `contamination.max_overlap` of its 13-gram fingerprints with an
evaluation item. The demo builders use a stricter rule, as real pipelines do when they decontaminate:
after the train/validation split, a training document that shares *any* fingerprint
(ghostvis_core/data/ngrams.py) with held-out text is dropped. For generated data that is right: a
templated row sharing one 13-word run with a held-out row is a near copy of it, and losing it costs
nothing but a regeneration. Held-out text is the validation documents of every source the builder
makes, whatever their kind (the gate compares across kinds), plus the evaluation items GhostVis ships
(ghostvis_core/data/eval_texts.py); through the winnowing guarantee, no demo training document then
repeats 20 consecutive words of any of them. The two builders (stdlib text, generated tasks) are not
checked against each other, which would cost the task build a ~5 s read of the stdlib: their texts
share no 13-word run at all, and tests/test_demo_corpus.py holds them to that.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import cache
from typing import TypeVar

from ghostvis_core.data.eval_texts import shipped_texts
from ghostvis_core.data.ngrams import fingerprints

T = TypeVar("T")


@cache
def shipped_fingerprints() -> frozenset[int]:
    """The fingerprints of the shipped evaluation items (computed once per process: every build needs them)."""
    return frozenset(h for text in shipped_texts() for h in fingerprints(text))


def held_out_fingerprints(texts: Iterable[str]) -> frozenset[int]:
    """The fingerprints a training document must not share: those of `texts` (validation documents)
    and of the shipped evaluation items."""
    held = set(shipped_fingerprints())
    for text in texts:
        held |= fingerprints(text)
    return frozenset(held)


def drop_shared(train: Sequence[T], text_of: Callable[[T], str], held_out: frozenset[int]) -> list[T]:
    """The training documents, in order, whose text shares no fingerprint with `held_out`."""
    return [doc for doc in train if held_out.isdisjoint(fingerprints(text_of(doc)))]

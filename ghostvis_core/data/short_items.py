"""Short evaluation items matched whole: an item of fewer than NGRAM words has no 13-gram,
hence no fingerprint (ghostvis_core/data/ngrams.py), so the fingerprint comparison cannot see it. As
in the GPT-3 and Llama 2 contamination studies, such an item is matched as a whole instead: a training
text contains it when the item's normalized words (ngrams.normalize: lowercased, punctuation and
whitespace ignored) occur in the text's normalized words, all of them, consecutively and in order.

An item of fewer than MIN_WORDS words is not matched: "3 + 4 =" normalizes to the two words "3 4",
which ordinary text holds by chance, so a match would say nothing about a leak. Such an item is not
checkable, and the gate fails an evaluation set none of whose items is checkable.

The training side is the documents' text (the raw rows, read by the gate; the demo builders' rows),
never the ledger's fingerprints: a winnowed sample cannot prove that a short run of words is absent.
One pass per text: its words become a set; the items whose anchor (longest word) is in it are the
candidates; each is looked for in the text's words joined by single spaces, padded so that a match
starts and ends on word boundaries. Cost per million documents: benchmarks/short_items.py.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from ghostvis_core.data.ngrams import NGRAM, normalize

MIN_WORDS = 4  # fewest words a short item needs to be matched whole: fewer match ordinary text by chance


def whole_phrase(text: str) -> str | None:
    """A short item's normalized words joined by single spaces, or None: the text has NGRAM words or
    more (its fingerprints check it), or fewer than MIN_WORDS (it cannot be checked)."""
    words = normalize(text)
    return " ".join(words) if MIN_WORDS <= len(words) < NGRAM else None


class WholeItems:
    """An index of short items' phrases (whole_phrase), searched in one training text at a time."""

    def __init__(self, phrases: Iterable[str]):
        self.by_anchor: dict[str, set[str]] = defaultdict(set)
        for phrase in phrases:
            self.by_anchor[max(phrase.split(), key=len)].add(phrase)

    def __bool__(self) -> bool:
        return bool(self.by_anchor)

    def found_in(self, text: str) -> set[str]:
        """The phrases the text contains whole, on word boundaries."""
        words = normalize(text)
        anchors = self.by_anchor.keys() & set(words)
        if not anchors:
            return set()
        padded = f" {' '.join(words)} "
        return {p for a in anchors for p in self.by_anchor[a] if f" {p} " in padded}

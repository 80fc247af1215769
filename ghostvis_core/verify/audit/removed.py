"""Tokens before = tokens kept + tokens removed, per text shard and in total.

Tokenization removes documents (filters, empty texts, exact duplicates, cross-shard near duplicates:
data/dedup.py) and counts them in the ledger's shard record (`docs_dropped`, `tokens_dropped`,
`drop_reasons`). This check does not take the writer's word for it: it tokenizes every raw document of
the shard again (its own row rule: `<|bos|>` + the text's tokens, nothing for an empty text), reads
the kept documents from the token file with the audit's reader, and recounts the raw rows missing from
the token file. Text shards only: other kinds render records (chats, pairs, captions) into tokens.
Its outcome is bounded whatever the number of shards: totals on every side, the number of shards
checked and disagreeing, and a table of only the shards that disagree.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from ghostvis_core.data.bpe_tokenizer import Tokenizer, load_tokenizer
from ghostvis_core.data.catalog import raw_content
from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.ledger.records import ShardRecord
from ghostvis_core.errors import GhostvisError
from ghostvis_core.store import Store
from ghostvis_core.verify.audit.check_outcome import CheckOutcome
from ghostvis_core.verify.audit.token_files import TokenFile

HEADER = [
    "shard",
    "docs before",
    "docs kept",
    "docs removed (ledger)",
    "docs removed (recount)",
    "tokens before",
    "tokens kept",
    "tokens removed (ledger)",
    "tokens removed (recount)",
    "removed by reason (ledger)",
]


@dataclass
class ShardTally:
    """One shard's documents and tokens before tokenization, kept (token file) and removed (ledger, recount)."""

    shard_id: str
    before: tuple[int, int]  # (docs, tokens): every raw document tokenized again
    kept: tuple[int, int]  # the token file
    removed_ledger: tuple[int, int]
    removed_recount: tuple[int, int]  # the raw rows missing from the token file, tokenized again
    reasons: dict[str, dict[str, int]]
    problems: list[str] = field(default_factory=list)

    def row(self) -> list[Any]:
        return [
            self.shard_id,
            self.before[0],
            self.kept[0],
            self.removed_ledger[0],
            self.removed_recount[0],
            self.before[1],
            self.kept[1],
            self.removed_ledger[1],
            self.removed_recount[1],
            json.dumps(self.reasons, sort_keys=True),
        ]

    def failures(self) -> list[str]:
        """Each equation that does not hold, with both sides and the fix."""
        out, fix = list(self.problems), f"re-materialize tokenized_shards partition {self.shard_id}"
        for i, what in enumerate(("docs", "tokens")):
            if self.before[i] != self.kept[i] + self.removed_ledger[i]:
                out.append(
                    f"shard {self.shard_id}: {what} before {self.before[i]} (raw documents tokenized again) != "
                    f"kept {self.kept[i]} (token file) + removed {self.removed_ledger[i]} (ledger); {fix}"
                )
            if self.removed_ledger[i] != self.removed_recount[i]:
                out.append(
                    f"shard {self.shard_id}: ledger removed {self.removed_ledger[i]} {what}, the raw rows "
                    f"missing from the token file hold {self.removed_recount[i]}; {fix}"
                )
            by_reason = sum(d[what] for d in self.reasons.values())
            if by_reason != self.removed_ledger[i]:
                out.append(
                    f"shard {self.shard_id}: the ledger's drop reasons sum to {by_reason} {what}, its "
                    f"{what}_dropped is {self.removed_ledger[i]}; {fix}"
                )
        return out


def removed_tokens_reconcile(store: Store, ledger: Ledger, tokenizer_id: str) -> CheckOutcome:
    """Per text shard of the tokenizer (each version a run may have trained) and in total: before = kept +
    removed, removed (ledger) = removed (recount), and the ledger's reasons sum to its totals. The table
    lists the shards that disagree only: one row per shard of a 10,000-shard ledger would be kept in every
    check event."""
    tok = load_tokenizer(tokenizer_id, store)
    tallies, other_kinds = [], []
    for record in ledger.shards(tokenizer_id=tokenizer_id, every_version=True):
        if record.kind == "text":
            tallies.append(tally_shard(store, tok, record))
        else:
            other_kinds.append(record.shard_id)
    failing = {t.shard_id: t.failures() for t in tallies}
    disagreeing = [t for t in tallies if failing[t.shard_id]]
    failures = [f for t in disagreeing for f in failing[t.shard_id]]
    figures = {
        "shards_checked": len(tallies),
        "shards_disagreeing": len(disagreeing),
        "shards_not_text": len(other_kinds),
    }
    for name in ("before", "kept", "removed_ledger", "removed_recount"):
        figures[f"docs_{name}"] = sum(getattr(t, name)[0] for t in tallies)
        figures[f"tokens_{name}"] = sum(getattr(t, name)[1] for t in tallies)
    if figures["tokens_before"] != figures["tokens_kept"] + figures["tokens_removed_ledger"]:
        failures.append(
            f"in total: tokens before {figures['tokens_before']} != kept {figures['tokens_kept']} + "
            f"removed {figures['tokens_removed_ledger']} (ledger)"
        )
    return CheckOutcome(
        "removed_tokens_reconcile",
        not failures,
        figures,
        {"disagreeing_shards": (HEADER, [t.row() for t in disagreeing])},
        failures,
    )


def tally_shard(store: Store, tok: Tokenizer, record: ShardRecord) -> ShardTally:
    """The shard's raw documents tokenized again, against its token file and its ledger record."""
    sid = record.shard_id
    reasons = json.loads(record.drop_reasons or "{}")
    removed_ledger = (record.docs_dropped, record.tokens_dropped)
    try:
        per_row = raw_document_tokens(store, tok, sid, record.content_sha256)
        kept = TokenFile(store.fetch("token_shard", tok.tokenizer_id, sid, record.content_sha256), sid)
    except GhostvisError as exc:
        return ShardTally(sid, (-1, -1), (-1, -1), removed_ledger, (-1, -1), reasons, [str(exc)])
    problems = []
    kept_rows = kept.rows.tolist()
    if len(set(kept_rows)) != len(kept_rows) or (
        kept_rows and not 0 <= min(kept_rows) <= max(kept_rows) < len(per_row)
    ):
        problems.append(
            f"shard {sid}: the token file's rows are not distinct raw rows of the shard (0..{len(per_row) - 1}); "
            f"re-materialize tokenized_shards partition {sid}"
        )
    missing = np.setdiff1d(np.arange(len(per_row)), kept.rows)
    return ShardTally(
        sid,
        (len(per_row), int(per_row.sum())),
        (kept.num_docs, kept.num_tokens),
        removed_ledger,
        (len(missing), int(per_row[missing].sum())),
        reasons,
        problems,
    )


def raw_document_tokens(store: Store, tok: Tokenizer, shard_id: str, content_sha256: str) -> np.ndarray:
    """Per raw row, the tokens its document is trained as: <|bos|> + its text's tokens (0 for an empty
    text, which tokenization drops as empty_text), from the raw file the ledger recorded (the shard's
    version with that content)."""
    path = raw_content(store, shard_id, content_sha256)
    texts = [t or "" for t in pq.read_table(path, columns=["text"]).column("text").to_pylist()]
    ids = tok.enc.encode_ordinary_batch(texts)
    return np.array([len(x) + 1 if t else 0 for t, x in zip(texts, ids)], dtype=np.int64)

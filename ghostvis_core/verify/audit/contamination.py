"""The decontamination gate: the training documents a stage consumed, compared with every
evaluation set the project knows, by their 13-gram fingerprints (ghostvis_core/data/ngrams.py).

Training side: the fingerprints tokenization recorded per document in the ledger's `ngrams` table, for
the documents the run's chain consumed (consumption rows: shard, raw rows [row_start, row_end)).
Evaluation side, reduced by the same rule:
- `validation`: every validation shard in the ledger, one item per document (its `ngrams` rows);
- `lm_eval:<file>`: the shipped lm-evaluation-harness tasks' JSON Lines (ghostvis_core/resources/lm_eval_tasks);
- `benchmark:<task>`: the multiple-choice benchmark's templated items, context + right answer;
- `prompts`: the fixed prompts every stage is sampled with;
- `user:<file>`: the JSON Lines or Parquet files (or folders of them) the stage config lists in
  `contamination.eval_sets`.
The cloze task and the benchmark's next-line items are cut from validation shards, so `validation`
covers them. A pair (training document, evaluation item) is contaminated when the fingerprints they
share exceed `contamination.max_overlap` of the smaller one's fingerprints.

An item of fewer than 13 words has no fingerprint; it is matched whole
(ghostvis_core/data/short_items.py) against the text of the consumed rows, read from the raw shards:
a consumed document that holds it is contaminated. An evaluation set none of whose items can be
checked (each shorter than whole_items.MIN_WORDS words) fails the check by name instead of passing
on nothing. An rl run trains on the completions it generates as well as on its prompts (consumed rows
like any other): every completion its ledger's rollouts saved is decoded with the run's tokenizer and
compared by fingerprints, named by step, rank and global row; one that reproduces a long item (13 words or
more) can only have it from memory, and fails the gate. A completion that writes a short item whole is listed,
not failed: such an item is a single right answer ("Step 1: 10 + 2 = 12."), which any policy that can do the
task writes from the problem it was given (its prompt and answer are consumed rows, checked above), so no
evaluation text entered training through it. Short validation documents are not matched whole: the ledger
keeps their fingerprints, not their text.
"""

from __future__ import annotations

import json
import math
import random
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from ghostvis_core.data.bpe_tokenizer import load_tokenizer
from ghostvis_core.data.catalog import raw_content
from ghostvis_core.data.eval_texts import (
    BENCHMARK_PER_TASK,
    BENCHMARK_SEED,
    LM_EVAL_TASKS_DIR,
    PROMPTS,
    item_text,
    template_choices,
)
from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.ledger.records import ConsumptionRow, PartRow, ShardRecord
from ghostvis_core.data.ngrams import TEXT_COLUMNS, fingerprints, record_text
from ghostvis_core.data.short_items import MIN_WORDS, WholeItems, whole_phrase
from ghostvis_core.errors import GhostvisError
from ghostvis_core.plan.config import ContaminationConfig
from ghostvis_core.runs.launch_spec import shard_versions
from ghostvis_core.store import Store
from ghostvis_core.verify.audit.check_outcome import CheckOutcome, union

NAMED = 20  # contaminated pairs named one by one in a check's failures and tables
COMPLETION = "rl completion"  # the "shard" of a generated completion: "rl completion, step S rank R"


@dataclass(frozen=True)
class EvalItem:
    eval_set: str
    item: str  # where in the set: a line number, a task item, a validation shard and row
    fps: frozenset[int]
    phrase: str | None = None  # a short item's normalized words, matched whole (whole_items.py)

    @classmethod
    def of(cls, eval_set: str, item: str, text: str) -> EvalItem:
        return cls(eval_set, item, frozenset(fingerprints(text)), whole_phrase(text))

    @property
    def checkable(self) -> bool:
        return bool(self.fps) or self.phrase is not None


@dataclass(frozen=True)
class Match:
    """A training document and an evaluation item that share fingerprints."""

    shard_id: str
    row: int
    eval_set: str
    item: str
    shared: int
    doc_fps: int
    item_fps: int
    whole: str | None = None  # the short item's phrase, when the document holds it whole

    @property
    def overlap(self) -> float:
        """Shared fingerprints over the smaller side's: 1.0 when one text is inside the other (or the
        document holds a short item whole)."""
        return 1.0 if self.whole else self.shared / max(1, min(self.doc_fps, self.item_fps))

    def row_of(self) -> list[Any]:
        return [
            self.shard_id,
            self.row,
            self.eval_set,
            self.item,
            self.shared,
            self.doc_fps,
            self.item_fps,
            round(self.overlap, 3),
            f"whole: {self.whole}" if self.whole else "13-grams",
        ]

    def failure(self, max_overlap: float) -> str:
        where = (
            f"{self.shard_id}, global row {self.row}"
            if self.shard_id.startswith(COMPLETION)
            else f"training shard {self.shard_id} row {self.row}"
        )
        if self.whole:
            return (
                f'{where} holds {self.eval_set} {self.item} whole ("{self.whole}", {len(self.whole.split())} '
                "words, too short for 13-gram fingerprints, matched as a whole)"
            )
        return (
            f"{where} shares {self.shared} 13-gram fingerprints with {self.eval_set} {self.item} (document "
            f"{self.doc_fps}, item {self.item_fps}): overlap {self.overlap:.2f} > contamination.max_overlap "
            f"{max_overlap}"
        )


MATCH_HEADER = [
    "shard",
    "row",
    "eval set",
    "item",
    "shared",
    "doc fingerprints",
    "item fingerprints",
    "overlap",
    "match",
]


def jsonl_items(path: Path, eval_set: str) -> Iterator[EvalItem]:
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise GhostvisError(
                f"evaluation set {path}, line {n}: not JSON ({exc}); fix the file or remove it "
                "from contamination.eval_sets"
            ) from None
        yield EvalItem.of(eval_set, f"line {n}", item_text(record) if isinstance(record, dict) else str(record))


def parquet_items(path: Path, eval_set: str) -> Iterator[EvalItem]:
    """One item per row of a Parquet file (its string columns, and choices[answer]: item_text)."""
    try:
        records = pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises several types for a file that is not Parquet
        raise GhostvisError(
            f"evaluation set {path}: not a readable Parquet file ({exc}); fix the file or remove it "
            "from contamination.eval_sets"
        ) from None
    for n, record in enumerate(records):
        yield EvalItem.of(eval_set, f"row {n}", item_text(record))


EVAL_FILES = {".jsonl": jsonl_items, ".parquet": parquet_items}


def file_sets(paths: list[str], prefix: str) -> Iterator[EvalItem]:
    """Items of JSON Lines or Parquet files, or of every such file under a folder; a missing path is an error."""
    for entry in paths:
        root = Path(entry).expanduser()
        if not root.exists():
            raise GhostvisError(
                f"evaluation set {entry} does not exist; fix contamination.eval_sets "
                "(JSON Lines or Parquet files, or folders of them)"
            )
        files = sorted(f for f in root.rglob("*") if f.suffix in EVAL_FILES) if root.is_dir() else [root]
        for f in files:
            read = EVAL_FILES.get(f.suffix, jsonl_items)
            yield from read(f, f"{prefix}:{f.relative_to(root) if root.is_dir() else f.name}")


def validation_items(ledger: Ledger) -> Iterator[EvalItem]:
    """One item per document of every validation shard in the ledger, every version of it (a run may have
    been evaluated on an earlier one), from its recorded fingerprints."""
    shas = sorted({r.content_sha256 for r in ledger.shards(every_version=True) if r.split == "validation"})
    current = {(r.shard_id, r.content_sha256) for r in ledger.shards()}
    for d in sorted(ledger.document_fingerprints(shas), key=lambda d: (d.shard_id, d.content_sha256, d.row)):
        version = "" if (d.shard_id, d.content_sha256) in current else f" (earlier version {d.content_sha256[:12]})"
        yield EvalItem("validation", f"{d.shard_id}{version} row {d.row}", frozenset(d.ngram_hashes))


def known_items(ledger: Ledger, eval_sets: list[str]) -> list[EvalItem]:
    """Every evaluation item the project knows, fingerprinted (see the module docstring)."""
    items = list(validation_items(ledger))
    items += file_sets([str(LM_EVAL_TASKS_DIR)], "lm_eval")
    choices = template_choices(random.Random(BENCHMARK_SEED), BENCHMARK_PER_TASK)
    for n, (task, context, options, answer) in enumerate(choices, start=1):
        items.append(EvalItem.of(f"benchmark:{task}", f"item {n}", context + options[answer]))
    items += [EvalItem.of("prompts", p, p) for p in PROMPTS]
    items += file_sets(eval_sets, "user")
    return items


def matches(docs: dict[tuple[str, int], set[int]], items: list[EvalItem]) -> list[Match]:
    """Every (training document, evaluation item) pair sharing a fingerprint, most overlap first."""
    index: dict[int, list[int]] = defaultdict(list)
    for i, it in enumerate(items):
        for h in it.fps:
            index[h].append(i)
    out = []
    for (shard_id, row), fps in docs.items():
        shared: dict[int, int] = defaultdict(int)
        for h in fps:
            for i in index.get(h, ()):
                shared[i] += 1
        out += [
            Match(shard_id, row, items[i].eval_set, items[i].item, n, len(fps), len(items[i].fps))
            for i, n in shared.items()
        ]
    return by_overlap(out)


def whole_matches(texts: dict[tuple[str, int], str], items: list[EvalItem]) -> list[Match]:
    """Every (training document, short evaluation item) pair where the document holds the item whole."""
    by_phrase: dict[str, list[EvalItem]] = defaultdict(list)
    for it in items:
        if it.phrase is not None:
            by_phrase[it.phrase].append(it)
    index = WholeItems(by_phrase)
    out = []
    for (shard_id, row), text in texts.items():
        for phrase in index.found_in(text) if index else ():
            out += [Match(shard_id, row, it.eval_set, it.item, 0, 0, 0, phrase) for it in by_phrase[phrase]]
    return out


def by_overlap(found: list[Match]) -> list[Match]:
    return sorted(found, key=lambda m: (-m.overlap, -m.shared, m.shard_id, m.row, m.eval_set, m.item))


def set_table(items: list[EvalItem]) -> list[list[Any]]:
    """Per evaluation set: items, checkable items (with a fingerprint or matched whole), those matched
    whole, fingerprints."""
    by: dict[str, list[int]] = {}
    for it in items:
        agg = by.setdefault(it.eval_set, [0, 0, 0, 0])
        agg[0] += 1
        agg[1] += it.checkable
        agg[2] += it.phrase is not None
        agg[3] += len(it.fps)
    return [[name, *by[name]] for name in sorted(by)]


def unchecked_sets(items: list[EvalItem]) -> list[str]:
    """A failure per evaluation set that has items but none the gate can check."""
    return [
        f"evaluation set {name} has {n} items and none can be checked (each is shorter than {MIN_WORDS} "
        "words once normalized: no fingerprint, too short to match whole); give it longer items or remove "
        "it from contamination.eval_sets"
        for name, n, checkable, _, _ in set_table(items)
        if checkable == 0
    ]


def consumed_spans(consumption: list[ConsumptionRow]) -> dict[str, list[tuple[int, int]]]:
    """Per consumed shard, its consumed raw row ranges, merged and sorted."""
    spans: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for c in consumption:
        spans[c.shard_id].append((c.row_start, c.row_end))
    return {s: union(v) for s, v in spans.items()}


def consumed_documents(
    ledger: Ledger, spec: Any, consumption: list[ConsumptionRow]
) -> tuple[dict[tuple[str, int], set[int]], list[str]]:
    """(shard_id, raw row) -> fingerprints of every document the consumption rows touch, and the
    consumed shards with no n-gram record (tokenized before the gate existed)."""
    content = shard_contents(ledger, spec)
    merged = consumed_spans(consumption)
    missing = sorted(s for s in merged if s not in content or not ledger.ngram_record_path(s, content[s]).exists())
    wanted = {content[s]: s for s in merged if s not in missing}
    starts = {s: [a for a, _ in v] for s, v in merged.items()}
    docs: dict[tuple[str, int], set[int]] = {}
    for d in ledger.document_fingerprints(sorted(wanted)):
        shard_id, row = d.shard_id, d.row
        if wanted.get(d.content_sha256) != shard_id:
            continue
        i = bisect_right(starts[shard_id], row) - 1  # the merged row range starting at or before the row
        if i >= 0 and row < merged[shard_id][i][1]:
            docs[(shard_id, row)] = set(d.ngram_hashes)
    return docs, missing


def shard_contents(ledger: Ledger, spec: Any) -> dict[str, str]:
    """shard_id -> content sha256 of the run's shards (the versions its launch spec selected, over the
    ledger's newest records for a shard it did not select)."""
    content = {r.shard_id: r.content_sha256 for r in ledger.shards(tokenizer_id=spec.tokenizer_id)}
    return content | shard_versions(spec.train_shards, spec.val_shards)


def consumed_texts(
    store: Store, ledger: Ledger, spec: Any, consumption: list[ConsumptionRow]
) -> dict[tuple[str, int], str]:
    """(shard_id, raw row) -> the text of every consumed document (ngrams.record_text, as tokenization
    fingerprints it), read from the raw shards in the version the run consumed (a shard changed since is
    read from its kept version); no version with that content is an error naming the fix."""
    content = shard_contents(ledger, spec)
    kinds = {r.shard_id: r.kind for r in ledger.shards(tokenizer_id=spec.tokenizer_id)}
    texts: dict[tuple[str, int], str] = {}
    for shard_id, spans in sorted(consumed_spans(consumption).items()):
        path = (
            raw_content(store, shard_id, content[shard_id])
            if shard_id in content
            else store.fetch("raw_shard", shard_id)
        )
        kind = kinds.get(shard_id, "text")
        table = pq.read_table(path, columns=TEXT_COLUMNS[kind])
        for start, end in spans:
            for row, record in enumerate(table.slice(start, end - start).to_pylist(), start=start):
                texts[(shard_id, row)] = record_text(kind, record)
    return texts


def completion_texts(store: Store, ledger: Ledger, spec: Any, chain: list[PartRow]) -> dict[tuple[str, int], str]:
    """("rl completion, step S rank R", global row) -> the text of every completion an rl run's rollouts
    saved on its chain (none for other stages), decoded with the run's tokenizer."""
    rollouts = ledger.rollouts(chain)
    if not rollouts:
        return {}
    tok = load_tokenizer(spec.tokenizer_id, store)
    return {
        (f"{COMPLETION}, step {r.step} rank {r.rank}", row): tok.decode(ids)
        for r in rollouts
        for row, ids in zip(r.rows, r.completion_ids)
    }


def gate_config(spec: Any) -> ContaminationConfig:
    """The run's declared gate (its launch spec's config; a spec saved before the gate gets the defaults)."""
    return spec.config.contamination


def own_validation_hints(bad: list[Match]) -> list[str]:
    """Per source whose training documents are contaminated by its own validation split: what was found,
    that templated data (generated problems, forms) shares n-grams with its own held-out rows without
    sharing content, and the setting that declares it."""
    own: dict[str, list[Match]] = defaultdict(list)
    for m in bad:
        source = m.shard_id.split("/", 1)[0]
        if m.eval_set == "validation" and not m.whole and m.item.split("/", 1)[0] == source:
            own[source].append(m)
    out = []
    for source, pairs in sorted(own.items()):
        top = max(m.overlap for m in pairs)
        out.append(
            f"{len(pairs)} contaminated pair(s) are source {source}'s training documents against its own "
            f"validation split (overlap up to {top:.2f}): expected when {source}'s documents are generated from "
            f"templates (train and validation rows share the template's words, not their content); if so, declare "
            f"it for this stage with --set contamination.max_overlap={math.ceil(top * 100) / 100:g} (the run "
            f"config's contamination.max_overlap, which applies to every evaluation set), else its validation "
            f"split holds copies of training documents: deduplicate the source or pin other validation shards"
        )
    return out


def no_eval_contamination(
    store: Store, ledger: Ledger, spec: Any, consumption: list[ConsumptionRow], chain: list[PartRow]
) -> CheckOutcome:
    """The stage check: no consumed training document (nor rl completion on the run's `chain`) shares
    more than `max_overlap` of the smaller side's 13-gram fingerprints with an evaluation item, nor does a
    consumed document hold a short item whole; each offending pair is named, and so is each evaluation set
    that cannot be checked at all. Completions that write a short item whole are counted and listed (the
    module docstring says why they pass)."""
    cfg = gate_config(spec)
    docs, missing = consumed_documents(ledger, spec, consumption)
    completions = completion_texts(store, ledger, spec, chain)
    docs |= {key: fingerprints(text) for key, text in completions.items()}
    items = known_items(ledger, cfg.eval_sets)
    whole = whole_matches(consumed_texts(store, ledger, spec, consumption), items)
    answered = whole_matches(completions, items)
    found = by_overlap(whole + matches(docs, items))
    bad = [m for m in found if m.overlap > cfg.max_overlap or m.whole]
    failures = [m.failure(cfg.max_overlap) for m in bad[:NAMED]]
    if len(bad) > NAMED:
        failures.append(f"... and {len(bad) - NAMED} more contaminated pairs")
    failures += own_validation_hints(bad)
    failures += [
        f"training shard {s} was consumed but has no n-gram record in the ledger (tokenized before the "
        f"decontamination gate); re-materialize tokenized_shards partition {s}"
        for s in missing
    ]
    failures += unchecked_sets(items)
    figures = {
        "consumed_documents_fingerprinted": len(docs) - len(completions),
        "consumed_fingerprints": sum(len(f) for f in docs.values()),
        "eval_items": len(items),
        "eval_items_checkable": sum(1 for it in items if it.checkable),
        "eval_items_matched_whole": sum(1 for it in items if it.phrase is not None),
        "eval_fingerprints": sum(len(it.fps) for it in items),
        "documents_sharing_ngrams": len({(m.shard_id, m.row) for m in found if not m.whole}),
        "documents_holding_short_items": len({(m.shard_id, m.row) for m in whole}),
        "contaminated_documents": len({(m.shard_id, m.row) for m in bad}),
        "contaminated_eval_items": len({(m.eval_set, m.item) for m in bad}),
        "max_overlap_found": round(found[0].overlap, 3) if found else 0.0,
        "max_overlap": cfg.max_overlap,
        "shards_without_ngrams": len(missing),
        "rl_completions_checked": len(completions),
        "rl_completions_writing_short_items": len({(m.shard_id, m.row) for m in answered}),
    }
    tables = {
        "shared_ngrams": (
            MATCH_HEADER + ["verdict"],
            [
                [*m.row_of(), "contaminated" if m.whole or m.overlap > cfg.max_overlap else "below threshold"]
                for m in found[:NAMED]
            ]
            + [[*m.row_of(), "written by the policy (an answer, not eval text)"] for m in by_overlap(answered)[:NAMED]],
        ),
        "eval_sets": (["eval set", "items", "checkable", "matched whole", "fingerprints"], set_table(items)),
    }
    return CheckOutcome("no_eval_contamination", not failures, figures, tables, failures)


def shard_contamination(
    ledger: Ledger, shards: list[ShardRecord], eval_sets: Sequence[str] = (), max_overlap: float | None = None
) -> dict[str, dict[str, int]]:
    """Per train shard of `shards` (ledger records): fingerprints shared with evaluation data, documents
    sharing any, and documents over the default threshold (`ghostvis ledger`). From the ledger's
    fingerprints only: short items matched whole need the raw text, which the stage check reads."""
    limit = ContaminationConfig().max_overlap if max_overlap is None else max_overlap
    train = {r.content_sha256: r.shard_id for r in shards if r.split == "train"}
    docs = {
        (d.shard_id, d.row): set(d.ngram_hashes)
        for d in ledger.document_fingerprints(sorted(train))
        if train.get(d.content_sha256) == d.shard_id
    }
    eval_fps = set()
    items = known_items(ledger, list(eval_sets))
    for it in items:
        eval_fps |= it.fps
    out = {s: {"shared_ngrams": 0, "docs_sharing": 0, "docs_contaminated": 0} for s in sorted(train.values())}
    for (shard_id, _), fps in docs.items():
        n = len(fps & eval_fps)
        out[shard_id]["shared_ngrams"] += n
        out[shard_id]["docs_sharing"] += bool(n)
    for shard_id, _ in {(m.shard_id, m.row) for m in matches(docs, items) if m.overlap > limit}:
        out[shard_id]["docs_contaminated"] += 1
    return out

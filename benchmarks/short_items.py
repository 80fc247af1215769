"""The cost of matching short evaluation items whole (issue 43), per million training documents.

The decontamination gate reads the text of every consumed row from its raw shard (`consumed_texts`:
sha256 of the file, the kind's text columns, `record_text`) and looks for every evaluation item shorter
than 13 words in it (`whole_matches`, ghostvis_core/data/short_items.py), against every item GhostVis
ships (154 of them are short). Here both run on one synthetic raw text shard of --docs documents of
--words words (random words of a 2,000-word vocabulary plus the words of the shipped items, so
candidates are found and ruled out as in real text; one document in 1,000 holds a capitals item), with
the gate's own functions; the figures are this process's CPU seconds (the machine is shared: wall
time is printed too), scaled to a million documents. Goal: under 5 minutes of one core per million
300-word documents.

    .venv/bin/python benchmarks/short_items.py [--docs 50000] [--words 300]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

GOAL_S_PER_MILLION = 300.0
PLANTED = "The capital of France is Paris."


def shard(store, docs: int, words: int, rng: random.Random) -> str:
    """A raw text shard of `docs` documents; its sha256."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ghostvis_core.data.eval_texts import shipped_texts
    from ghostvis_core.store.files import sha256_file

    vocab = [f"w{i}" for i in range(2000)] + sorted({w for t in shipped_texts() for w in t.split()})
    texts = [" ".join(rng.choices(vocab, k=words)) + (f" {PLANTED}" if i % 1000 == 0 else "") for i in range(docs)]
    path = store.writable("raw_shard", "bench/00000")
    pq.write_table(pa.table({"text": texts}), path)
    store.publish("raw_shard", "bench/00000")
    return sha256_file(path)


def measure(wd: Path, docs: int, words: int) -> dict:
    from ghostvis_core.data.ledger import Ledger
    from ghostvis_core.data.ledger.records import ShardRecord
    from ghostvis_core.data.shard_ref import ShardRef
    from ghostvis_core.store import FolderStore
    from ghostvis_core.verify.audit.contamination import consumed_texts, known_items, whole_matches

    store = FolderStore(wd / "store")
    content = shard(store, docs, words, random.Random(43))
    ledger = Ledger.in_store(store)
    ledger.write_shard(
        ShardRecord(shard_id="bench/00000", source="bench", split="train", kind="text", docs=docs,
                    content_sha256=content, raw_bytes=0, tokenizer_id="t", tokens=0, text_bytes=0, token_path="")
    )  # fmt: skip
    spec = SimpleNamespace(
        tokenizer_id="t",
        train_shards={"bench": (ShardRef("bench/00000", "bench", "train", "", docs, 0, content),)},
        val_shards={},
    )
    consumption = [SimpleNamespace(shard_id="bench/00000", row_start=0, row_end=docs)]  # a ConsumptionRow's span
    items = known_items(ledger, [])
    w0, t0 = time.perf_counter(), time.process_time()
    texts = consumed_texts(store, ledger, spec, consumption)
    t1 = time.process_time()
    found = whole_matches(texts, items)
    w2, t2 = time.perf_counter(), time.process_time()
    scale = 1_000_000 / docs
    return {
        "docs": docs,
        "words": words,
        "short_items": sum(1 for it in items if it.phrase),
        "read_s_per_million": (t1 - t0) * scale,
        "match_s_per_million": (t2 - t1) * scale,
        "total_s_per_million": (t2 - t0) * scale,
        "wall_s_per_million": (w2 - w0) * scale,
        "documents_found": len({(m.shard_id, m.row) for m in found}),
        "planted": -(-docs // 1000),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=50_000)
    ap.add_argument("--words", type=int, default=300)
    args = ap.parse_args()
    print(C.load_snapshot("before"))
    with C.work_folder("short-items") as wd:
        r = measure(wd, args.docs, args.words)
    if r["documents_found"] != r["planted"]:
        raise C.BenchError(f"found {r['documents_found']} documents holding an item, planted {r['planted']}")
    print(
        C.table(
            [[r["docs"], r["words"], r["short_items"], r["read_s_per_million"], r["match_s_per_million"]]],
            ["documents", "words each", "short items", "read CPU s / 1M docs", "match CPU s / 1M docs"],
        )
    )
    print(
        C.goal(
            "CPU seconds per million documents", r["total_s_per_million"], GOAL_S_PER_MILLION, higher_is_better=False
        )
    )
    print(C.kv_line(r))
    return 0


if __name__ == "__main__":
    C.main_wrapper(main)

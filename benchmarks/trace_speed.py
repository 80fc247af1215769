"""`ghostvis trace` on a ledger of 10,000 shards and 100 runs (issue 43): each answer in under 1 s.

A synthetic home is written in a temporary folder through the real writing APIs, nothing of it by
hand: a text source's manifest (`catalog.save_manifest`), --shards raw shards with their recorded
sha256, token files (`token_shard.write_token_shard`), ledger shard records, n-gram fingerprints
(`Ledger.write_shard`, `Ledger.write_ngrams`; then `Ledger.write_ngram_index`, as the token_ledger asset
does, timed), and --runs runs (stages in the stage table's order,
each a lineage's child of the one before it, 10 lineages) of 10 parts of 10 steps each, every part
through `Ledger.write_part` (consumption), and each run's row index through `Ledger.write_row_index` (what
its content proof writes), each run reading 800 shards from its own offset (lm rows, 32 per step, 4 rows per shard), so
a shard is read by 8 runs on average. Then, in this process as the CLI calls them (the ledger's files
are local; DuckDB's connection warm, as the command's own start-up is measured apart):

- `trace_document` (`ghostvis trace --doc <shard>:<row>`), `find_text` + `trace_document`
  (`--text`), `trace_step` (`--stage S --step N --run-key K`), each with its JSON rendering;
- the `ghostvis trace --doc ... --json --no-models` command's wall time, start-up included.

Goal: each answer <= 1 s (printed as the ratio to it). Registered models (MLflow) are not asked for.
`--home PATH` keeps the synthetic home there (built ~7 min on 2 shared cores) and reuses it when present.

    .venv/bin/python benchmarks/trace_speed.py [--shards 10000] [--runs 100] [--home PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

GOAL_S = 1.0
SOURCE = "bench"
DOCS, DOC_TOKENS = 20, 100  # per shard: 2,000 tokens
SEQ_LEN = 500  # 4 rows per shard
PLAN = {"micro_batch_size": 4, "seq_len": SEQ_LEN, "world_size": 4, "grad_accum_steps": 2}  # 32 rows a step
PARTS, STEPS_PER_PART = 10, 10
WORDS = [f"w{i}" for i in range(5000)]


def shard_id(i: int) -> str:
    return f"{SOURCE}/{i:05d}"


def write_shards(store, n: int, rng: random.Random) -> dict[str, str]:
    """Raw shards, token files, ledger shard records and fingerprints; shard id -> content sha256."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ghostvis_core.data.catalog import save_manifest
    from ghostvis_core.data.ledger import Ledger
    from ghostvis_core.data.ledger.records import NgramRow, ShardRecord
    from ghostvis_core.data.ngrams import fingerprints
    from ghostvis_core.data.shard_manifest import Manifest, ShardEntry
    from ghostvis_core.data.token_shard import list_column, write_token_shard
    from ghostvis_core.store.files import sha256_file

    ledger, contents = Ledger.in_store(store), {}
    entries = [ShardEntry(f"{i:05d}", f"file:///{i:05d}.parquet") for i in range(n)]
    save_manifest(store, Manifest(SOURCE, "text", entries))
    for i in range(n):
        sid = shard_id(i)
        texts = [" ".join(rng.choices(WORDS, k=40)) for _ in range(DOCS)]
        path = store.writable("raw_shard", sid)
        pq.write_table(pa.table({"text": texts}), path)
        store.publish("raw_shard", sid)
        sha = contents[sid] = sha256_file(path)
        store.write_json("raw_shard_meta", sid, data={"shard_id": sid, "sha256": sha, "bytes": 0, "split": "train"})
        tokens = store.writable("token_shard", "tok", sid, sha)
        flat = [rng.randrange(1, 4096) for _ in range(DOCS * DOC_TOKENS)]
        ids = list_column([DOC_TOKENS] * DOCS, flat, np.uint16)
        write_token_shard(tokens, {"tokens": ids, "row": pa.array(range(DOCS), pa.int64())}, "tok")
        store.publish("token_shard", "tok", sid, sha)
        ledger.write_shard(
            ShardRecord(shard_id=sid, source=SOURCE, split="train", kind="text", content_sha256=sha, raw_bytes=0,
                        tokenizer_id="tok", docs=DOCS, tokens=DOCS * DOC_TOKENS, text_bytes=0, token_path=str(tokens))
        )  # fmt: skip
        ngrams = [NgramRow(sid, SOURCE, "train", sha, r, h) for r, t in enumerate(texts) for h in fingerprints(t)]
        ledger.write_ngrams(sid, sha, ngrams)
    return contents


def run_rows(first_shard: int, n_shards: int, g: int) -> list[dict]:
    """The row index rows of global row g of a run whose token stream starts at shard `first_shard`."""
    a = g * SEQ_LEN
    i, off = divmod(a, DOCS * DOC_TOKENS)
    sid = shard_id((first_shard + i) % n_shards)
    return [{"shard_id": sid, "epoch": 0, "tok_start": off, "tok_end": off + SEQ_LEN}]


def write_runs(store, n_runs: int, n_shards: int, contents: dict[str, str]) -> list[tuple[str, str]]:
    """The runs' specs, parts, consumption and row indexes; [(stage, run_key)]."""
    from dataclasses import asdict

    from ghostvis_core.data.ledger import Ledger
    from ghostvis_core.data.ledger.records import ConsumptionRow, PartRow, RowIndexRow
    from ghostvis_core.data.shard_piece import Piece
    from ghostvis_core.data.shard_ref import ShardRef
    from ghostvis_core.plan.batch import BatchPlan
    from ghostvis_core.plan.stages import stage_names
    from ghostvis_core.verify.audit.row_index import place

    ledger, stages, runs = Ledger.in_store(store), stage_names(), []
    plan = BatchPlan(**PLAN)
    per_part = STEPS_PER_PART * plan.rows_per_step
    rows_per_run = PARTS * per_part
    for r in range(n_runs):
        stage = stages[r % len(stages)]
        key, parent = f"{stage}-bench{r:03d}", runs[-1][1] if r % len(stages) else ""
        first = r * 97 % n_shards
        read = sorted({run_rows(first, n_shards, g)[0]["shard_id"] for g in range(rows_per_run)})
        refs = [asdict(ShardRef(s, SOURCE, "train", "", 0, 0, contents[s])) for s in read]
        spec = {"stage": stage, "run_key": key, "tokenizer_id": "tok", "train_shards": {SOURCE: refs}, "val_shards": {}}
        store.write_json("run_spec", stage, key, data=spec | {"plan": {**PLAN, "steps": PARTS * STEPS_PER_PART}})
        prev, chain, index = "", [], []
        for p in range(PARTS):
            step_first, rows_first = p * STEPS_PER_PART + 1, p * per_part
            part = PartRow(
                part_id=f"{key}.s000.p{step_first + STEPS_PER_PART - 1:09d}",
                prev_part_id=prev,
                run_key=key,
                parent_run_key=parent,
                stage=stage,
                segment=0,
                step_first=step_first,
                step_last=step_first + STEPS_PER_PART - 1,
                rows_first=rows_first,
                rows_last=rows_first + per_part,
                real_tokens=per_part * SEQ_LEN,
                loss_tokens=per_part * SEQ_LEN,
                **PLAN,
                tokens_per_step=plan.tokens_per_step,
                planned_tokens=rows_per_run * SEQ_LEN,
            )
            rows = []
            for g in range(rows_first, rows_first + per_part):
                where = place(g - rows_first, plan)
                where["step"] += step_first - 1
                for sp in run_rows(first, n_shards, g):
                    raw = {"row_start": sp["tok_start"] // DOC_TOKENS, "row_end": -(-sp["tok_end"] // DOC_TOKENS)}
                    rows.append(RowIndexRow(part.part_id, key, stage, 0, **where, global_row=g, **sp, **raw))
            spans: dict[str, list[RowIndexRow]] = {}
            for x in rows:
                spans.setdefault(x.shard_id, []).append(x)
            pieces = [
                ConsumptionRow.of(
                    part,
                    Piece(SOURCE, sid, "train", 0, xs[0].tok_start, xs[-1].tok_end),
                    (xs[0].row_start, xs[-1].row_end),
                )
                for sid, xs in spans.items()
            ]
            ledger.write_part(part, pieces)
            chain, index, prev = chain + [part], index + rows, part.part_id
        ledger.write_row_index(chain, index)  # what the run's content proof writes
        runs.append((stage, key))
    return runs


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def measure(wd: Path, n_shards: int, n_runs: int) -> dict:
    import pyarrow.parquet as pq

    from ghostvis_core.data.ledger import Ledger
    from ghostvis_core.store import open_store
    from ghostvis_core.verify.trace import find_text, trace_document, trace_step

    store, built_file = open_store(str(wd / "store")), wd / "built.json"
    t0 = time.perf_counter()
    if built_file.exists():
        built = json.loads(built_file.read_text())
    else:
        contents = write_shards(store, n_shards, random.Random(43))
        built = {"runs": write_runs(store, n_runs, n_shards, contents), "seconds": time.perf_counter() - t0}
        built_file.write_text(json.dumps(built))
    runs = built["runs"]
    ledger = Ledger.in_store(store)
    sid, row = shard_id(n_shards // 2 + 1), 7
    text = pq.read_table(store.fetch("raw_shard", sid)).column("text")[row].as_py()
    stage, key = runs[n_runs // 2]
    ledger.run_links(ledger.run_heads()[:1])  # the process's DuckDB connection opened, as by any first query
    doc_s, doc = timed(lambda: json.dumps(trace_document(store, ledger, sid, row)))
    index_s, _ = timed(ledger.write_ngram_index)  # what token_ledger writes after tokenization

    def by_text() -> str:
        found = find_text(store, ledger, text)
        return json.dumps([trace_document(store, ledger, d["shard_id"], d["row"]) for d in found])

    text_s, found = timed(by_text)
    step_s, step = timed(lambda: json.dumps(trace_step(store, ledger, stage, 55, key)))
    env = C.clean_env(wd)
    cli = [*C.GHOSTVIS, "trace", "--doc", f"{sid}:{row}", "--json", "--no-models"]
    cli_s, proc = timed(lambda: subprocess.run(cli, env=env, capture_output=True, text=True))
    if proc.returncode != 0:
        raise C.BenchError(f"{' '.join(cli)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    doc, found, step = json.loads(doc), json.loads(found), json.loads(step)
    if not doc["trained_by"] or json.loads(proc.stdout)["trained_by"] != doc["trained_by"]:
        raise C.BenchError(f"{sid}:{row}: trained by no run, or the command's answer differs")
    if [d["document"]["shard_id"] for d in found] != [sid] or len(step["fed"]) != 32:
        raise C.BenchError(f"--text found {len(found)} documents, --step fed {len(step['fed'])} rows (want 1 and 32)")
    return {
        "shards": n_shards,
        "runs": n_runs,
        "build_s": built["seconds"],
        "ngram_index_s": index_s,
        "doc_runs": len({h["run_key"] for h in doc["trained_by"]}),
        "doc_hits": len(doc["trained_by"]),
        "doc_s": doc_s,
        "text_s": text_s,
        "step_s": step_s,
        "cli_doc_s": cli_s,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=10_000)
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--home", help="keep the synthetic home here, and reuse it when it is there")
    args = ap.parse_args()
    print(C.load_snapshot("before"))
    if args.home:  # kept, and reused when it is there
        Path(args.home).mkdir(parents=True, exist_ok=True)
        r = measure(Path(args.home), args.shards, args.runs)
    else:
        with C.work_folder("trace-speed") as wd:
            r = measure(wd, args.shards, args.runs)
    print(f"built {r['shards']:,} shards and {r['runs']} runs in {r['build_s']:.0f} s")
    print(f"the fingerprint index (token_ledger writes it): {r['ngram_index_s']:.1f} s")
    rows = [
        ["--doc --json", r["doc_s"], r["doc_s"] / GOAL_S],
        ["--text --json", r["text_s"], r["text_s"] / GOAL_S],
        ["--stage --step --json", r["step_s"], r["step_s"] / GOAL_S],
        ["ghostvis trace --doc (command)", r["cli_doc_s"], r["cli_doc_s"] / GOAL_S],
    ]
    print(C.table(rows, ["query", "seconds", "ratio to 1 s"]))
    print(f"the document: {r['doc_hits']} rows of {r['doc_runs']} runs")
    print(C.goal("slowest answer (s)", max(r["doc_s"], r["text_s"], r["step_s"]), GOAL_S, higher_is_better=False))
    print(C.kv_line(r))
    return 0


if __name__ == "__main__":
    C.main_wrapper(main)

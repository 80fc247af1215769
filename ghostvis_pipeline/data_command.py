"""`ghostvis data`: the backfill of every registered shard, in one Dagster run per asset (download,
tokenizer, tokenization, ledger), recorded in DAGSTER_HOME like a backfill started from the UI; then the
documents tokenization dropped, per shard and reason, a trained tokenizer smaller than the preset plans, and a
tokenizer kept while its training data changed (the shards revised upstream: tokenized with it, not retrained)."""

from __future__ import annotations

import time

from ghostvis_core.home import Home
from ghostvis_core.plan import selected
from ghostvis_core.plan.presets import vocabulary_note
from ghostvis_pipeline.subcommand import subcommand


def cmd_data(args) -> int:
    from dagster import DagsterInstance

    from ghostvis_core.data.shard_changes import tokenizer_data_changes
    from ghostvis_pipeline.assets.data import kept_tokenizer_note, made_of
    from ghostvis_pipeline.demo import format_summary, materialize_data
    from ghostvis_pipeline.environment import prepare_environment
    from ghostvis_pipeline.metadata import newest_metadata

    home = Home.from_env()
    prepare_environment(home)
    store = home.store
    t0 = time.time()
    brought = {"from_model": args.tokenizer_of} if args.tokenizer_of else {"from_file": args.tokenizer_file}
    trained = not (args.tokenizer_of or args.tokenizer_file)
    preset = args.preset or selected.default_preset()
    runs = materialize_data(DagsterInstance.get(), store, preset, None if trained else brought, args.retrain_tokenizer)
    print(format_summary(runs, time.time() - t0))
    tokenizer = newest_metadata(DagsterInstance.get(), "tokenizer")
    print("\n".join(dropped_lines(store, tokenizer["tokenizer_id"])))
    if trained and (note := vocabulary_note(tokenizer["tokenizer_id"], tokenizer["vocab_size"], preset)):
        print(f"note: {note}")
    made = made_of(store, tokenizer)
    if made and (changes := tokenizer_data_changes(store, made)):
        print(f"tokenizer: {kept_tokenizer_note(tokenizer['tokenizer_id'], changes)}")
    return 0 if all(passed for r in runs for *_, passed in r.checks) else 1


def dropped_lines(store, tokenizer_id: str) -> list[str]:
    """Per shard, the documents tokenization dropped and why (exact duplicates, filters, empty texts), so
    no drop is silent; the ledger keeps the same figures (`ghostvis ledger --json`: drop_reasons)."""
    import json

    from ghostvis_core.data.ledger import Ledger

    shards = Ledger.in_store(store).shards(tokenizer_id=tokenizer_id)
    lines = []
    for r in shards:
        if r.docs_dropped:
            reasons = ", ".join(
                f"{reason} {d['docs']:,} ({d['tokens']:,} tokens)" for reason, d in json.loads(r.drop_reasons).items()
            )
            lines.append(
                f"  {r.shard_id:<26} kept {r.docs:,} of {r.docs + r.docs_dropped:,} documents; dropped: {reasons}"
            )
    dropped = sum(r.docs_dropped for r in shards)
    head = f"dropped at tokenization: {dropped:,} of {sum(r.docs for r in shards) + dropped:,} documents"
    return [head + (":" if lines else ""), *lines]


def add_parser(sub) -> None:
    d = subcommand(
        sub, "data", help="backfill every registered shard: download, tokenizer, tokenization, ledger", fn=cmd_data
    )
    d.add_argument(
        "--preset", help="the preset whose tokenizer vocabulary to train (default: GHOSTVIS_PRESET, else tiny)"
    )
    brought = d.add_mutually_exclusive_group()
    brought.add_argument(
        "--tokenizer-of",
        metavar="MODEL",
        help="use this Hugging Face checkpoint's tokenizer.json instead of training one (a folder, s3://, "
        "hf://org/name@rev): the data is tokenized as the model you start a stage from (init_from) was trained",
    )
    brought.add_argument(
        "--tokenizer-file",
        metavar="FILE",
        help="use this tokenizer file instead of training one (a byte-level BPE tokenizer.json or a tiktoken BPE "
        "file; path, s3://, http(s)://, hf://); the tokenizer asset's run config maps special tokens",
    )
    brought.add_argument(
        "--retrain-tokenizer",
        action="store_true",
        help="train a new tokenizer on the current text shards (the tokenizer asset) even though one exists: by "
        "default a trained tokenizer is kept when shards change, and only the changed shards are tokenized with "
        "it; a new tokenizer tokenizes every shard again and makes every trained stage stale",
    )

"""Preference data as people have it: several pairs for one prompt are distinct records, all kept; only
the same prompt, chosen and rejected is an exact duplicate, dropped and counted in the ledger; and a
validation prompt with a pair in a train shard is found by the train/validation overlap check."""

from __future__ import annotations

import json

import pyarrow as pa

from ghostvis_core.data.bpe_tokenizer import save_tokenizer, train_tokenizer
from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.ledger.summaries import train_validation_overlap
from ghostvis_core.store import FolderStore
from ghostvis_pipeline.data_command import dropped_lines
from tests.raw_shards import raw_shard_job, tokenize_here

PROMPTS = ["Name a warm colour.", "Name a sea creature.", "Name a tall tree."]
REPLIES = {  # per prompt: (chosen, rejected) pairs, UltraFeedback-style
    PROMPTS[0]: [("Amber.", "Blue."), ("Crimson.", "Teal."), ("Orange.", "Grey.")],
    PROMPTS[1]: [("A whale.", "A fox."), ("An octopus.", "A hawk.")],
    PROMPTS[2]: [("A redwood.", "A daisy."), ("A larch.", "A moss.")],
}


def pairs() -> list[dict]:
    return [{"prompt": p, "chosen": c, "rejected": r} for p, replies in REPLIES.items() for c, r in replies]


def test_several_pairs_per_prompt_are_kept_a_duplicate_pair_dropped_and_a_validation_prompt_found_in_train(tmp_path):
    store = FolderStore(tmp_path / "store")
    rows = pairs()
    train_rows = [*rows, dict(rows[1])]  # the second pair again: an exact duplicate
    valid_rows = [{"prompt": PROMPTS[0], "chosen": "Scarlet.", "rejected": "Green."}]  # the prompt, another pair
    tok = train_tokenizer([" ".join(r.values()) for r in train_rows + valid_rows], 300)
    save_tokenizer(tok, store)
    jobs = [
        raw_shard_job(store, "prefs/00000", pa.Table.from_pylist(train_rows), kind="preference"),
        raw_shard_job(store, "prefs/00001", pa.Table.from_pylist(valid_rows), "validation", kind="preference"),
    ]
    tokenize_here(jobs, store, tok.tokenizer_id, tmp_path / "logs")
    ledger = Ledger.in_store(store)
    shards = {r.shard_id: r for r in ledger.shards(tokenizer_id=tok.tokenizer_id)}
    assert shards["prefs/00000"].docs == len(rows) == 7
    assert shards["prefs/00000"].docs_dropped == 1
    assert set(json.loads(shards["prefs/00000"].drop_reasons)) == {"exact_duplicate"}
    assert json.loads(shards["prefs/00000"].drop_reasons)["exact_duplicate"]["docs"] == 1
    assert shards["prefs/00001"].docs == 1
    dropped_tokens = json.loads(shards["prefs/00000"].drop_reasons)["exact_duplicate"]["tokens"]
    assert dropped_tokens > 0
    assert dropped_lines(store, tok.tokenizer_id) == [  # what `ghostvis data` prints after its runs
        "dropped at tokenization: 1 of 9 documents:",
        f"  {'prefs/00000':<26} kept 7 of 8 documents; dropped: exact_duplicate 1 ({dropped_tokens:,} tokens)",
    ]
    overlap = train_validation_overlap(ledger, list(shards.values()))
    assert sorted((o.validation_shard, o.validation_row, o.train_shard, o.train_row) for o in overlap) == [
        ("prefs/00001", 0, "prefs/00000", row) for row in range(3)
    ]

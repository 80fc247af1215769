"""Asset definitions, split by group: data (shards, tokenizer, ledger) and training (stages)."""

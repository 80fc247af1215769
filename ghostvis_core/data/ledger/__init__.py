"""The token ledger: append-only Parquet files, queried through DuckDB.

Tables in the artifact store's "ledger" artifact (`Ledger.in_store(store)`):
- shards/       one file per tokenized shard: what each shard holds (docs, tokens, bytes, drops).
- parts/        one file per checkpointed part of a training run segment: real/pad/loss/cropped
                tokens and the four tokens_per_step factors; `prev_part_id` chains the parts that
                lead to a checkpoint, so a run's totals are the sum along its chain; `passed_over`
                names the damaged checkpoints the part's segment resumed past (the steps it trained again).
- consumption/  per part, the (shard, epoch, token range, row range) pieces the loader delivered.
- shares/       per part and rank, that rank's share: the global rows it read and its four figures,
                so a rank whose rows or counts were dropped is visible (the part row is their sum).
- ngrams/       one file per tokenized shard: each document's winnowed 13-gram fingerprints, compared
                with the evaluation sets by the decontamination gate (ghostvis_core/verify/audit/contamination.py).
- feeds/        per part, rank and step: content digests of every micro-batch the rank fed the model
                (ghostvis_core/digest.py), which the audit recomputes from the token files.
- rollouts/     per part, rank and step of an rl run: the generated and rewarded tokens, and every
                completion the rank sampled (its global row, token ids, reward), from which the audit
                recounts the generated tokens and rebuilds the rows it fed.
- checkpoint_files/ per part that committed a checkpoint: the sha256 of each of the checkpoint's files, the copy
                of its COMPLETE marker's digests outside the checkpoint that a resume checks it against.
- ngram_index/  every shard's fingerprints in one file sorted by hash (row groups of NGRAM_INDEX_ROWS), named
                by the ngrams/ files it holds (listed in its metadata): written by the token_ledger asset,
                read by `ghostvis trace --text` with the ngrams/ files written since.
- timeline/     per run, one file per write of a launch's timeline (ghostvis_core/run/train/timeline.py): what rank 0
                of each training job and the launching side spent their time on (start-up, load, steps, evaluation,
                saves, the end and its reason), on each host's monotonic clock; read by `ghostvis goodput`.
- row_index/    per run, one file named as the head part of the chain it indexes: every planned global row
                of the chain, its part, segment, step, rank, micro-batch and the shard spans it read (tokens
                and raw rows), rebuilt by the audit (ghostvis_core/verify/audit/row_index.py) and sorted by
                shard: what `ghostvis trace` reads, one file per run, instead of the token files.
- dedup/        one file per cross-shard MinHash index of a source (ghostvis_core/data/dedup.py): each
                removed (shard, row), the (shard, row) it duplicates and the reason; written by dedup.py.

Many writers (tokenizer workers, training runs) each write their own file, atomically; nobody
rewrites a file. A file name is derived from its content key, so writing twice is harmless. The
ledger reads and writes through the artifact store (artifact kind "ledger_file"): `root` is this
node's copy, each written file is published at once, and a query fetches only the folders it reads.

The per-shard tables (shards, docs, ngrams) are flat folders. The per-part tables (parts and the tables
beside it, PART_TABLES, and row_index) keep a folder per run, hive-style: `<table>/stage=<stage>/run=<run_key>/
s<segment>.p<step_last>.parquet`, so a query about some runs opens only their files, and one about a
stage only that stage's: what the audit, the checks and `ghostvis ledger --run` read does not grow
with the number of other runs. A process queries through one DuckDB connection (`files.connection`).

The package: records.py (each table's row as a frozen dataclass, from which its schema and its written
table are derived, and the records of the readings), files.py (where the files are; the connection),
write.py (`LedgerWriter`, taking records), query.py (`LedgerQueries`, returning records), summaries.py
(run summaries and shard checks built on the queries).
"""

from ghostvis_core.data.ledger.query import LedgerQueries
from ghostvis_core.data.ledger.write import LedgerWriter


class Ledger(LedgerWriter, LedgerQueries):
    """The ledger of one folder (and the store it is published to): what writers append and queries read."""

"""Replay: sampled checkpoint intervals of a run re-executed from the checkpoint before them, on the rows the
ledger says were fed (built by the audit's own reader), and compared with the checkpoint after them.

- intervals.py: a run's intervals (between its starting weights and its kept checkpoints) and the seeded choice;
- refusal.py: the runs a replay cannot repeat bit for bit, refused by name;
- batches.py: an interval's micro-batches, per step and rank, from the ledger's feed records and the token files;
- steps.py: the optimizer steps of an interval, the ranks' gradient all-reduce repeated in one process;
- compare.py: weights and optimizer state against a checkpoint, tensor by tensor, bit for bit;
- worker.py: one interval in its own process (`python -m ghostvis_core.verify.replay.worker`);
- settings.py: K and the seed;
- record.py: where the verdict is kept, and its few words for the report card;
- check.py: the `replay_matches` check: K intervals, each in a worker, one verdict.
"""

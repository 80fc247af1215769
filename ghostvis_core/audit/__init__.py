"""Token accounting verified against the data: every stage figure recomputed from the store (token files,
ledger, launch spec, run record) and the MLflow store by a process other than the trainer.

- outcome.py   CheckOutcome (what a check compared, both sides) and range arithmetic
- recount.py   the four figures recounted from the token files over the consumed ranges
- expected.py  which rows and shard ranges the plan says the run had to read, vs the recorded ones;
               each rank's share of each part
- checks.py    every stage and data invariant as a plain function (the Dagster checks call them)
- report.py    `ghostvis audit`: all of them for every stage, one table per stage
"""

"""Token accounting verified against the data: every stage figure recomputed from the store (token files,
ledger, launch spec, run record) and the MLflow store by a process other than the trainer, with code
that shares nothing with the trainer's loader, objectives or loop (tests/test_code_shape.py).

- stage_checks.py  the one list of a stage's checks (Dagster checks, checks-only job, `ghostvis audit`)
- data_checks.py   the one list of the token ledger's checks (the same three users)
- outcome.py       CheckOutcome (what a check compared, both sides) and range arithmetic
- token_files.py   the audit's own reader of token files
- rebuild.py       the audit's own row rule: every row of a run's plan rebuilt from the token files
- content.py       the content proof: what each rank fed the model vs the rebuilt rows
- recount.py       the four figures recounted from the token files over the consumed ranges
- expected.py      which rows and shard ranges the plan says the run had to read, vs the recorded ones;
                   each rank's share of each part
- invariants.py    the other stage and data invariants as plain functions
- report.py        `ghostvis audit`: all of them for every stage, one table per stage
"""

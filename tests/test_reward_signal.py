"""An rl run none of whose completions earned a reward learned nothing, and says so: the smoke demo's rl (2
samples per prompt, 24 new tokens, from the demo's dpo, which never writes the `Answer:` line) is such a run,
read from the demo home's ledger as the rl materialization reads it."""

from __future__ import annotations

import pytest

from ghostvis_core.data.bpe_tokenizer import load_tokenizer
from ghostvis_core.data.ledger import Ledger
from ghostvis_core.home import Home
from ghostvis_core.runs.lookup import newest_completed_run
from ghostvis_core.verify.audit.invariants import StageRun
from ghostvis_core.verify.audit.reward_signal import answer_form, unrewarded_note


def test_the_answer_form_of_each_rule():
    assert answer_form("integer") == "an integer and nothing else (e.g. `42`)"
    assert answer_form("string") == "the answer itself"
    assert answer_form(r"regex:Answer:\s*(-?\d+)") == r"a whole match of `Answer:\s*(-?\d+)`"


@pytest.mark.e2e
def test_an_rl_run_with_no_rewarded_completion_says_so_with_the_rule_and_an_example(demo_home):
    store = Home(demo_home).store
    ledger = Ledger.in_store(store)
    run = StageRun.load(store, ledger, "rl", newest_completed_run(store, "rl").run_key)
    records = ledger.rollouts(run.chain)
    rewards = [reward for r in records for reward in r.rewards]
    assert rewards and set(rewards) == {0.0}  # the demo's rl: nothing to learn from
    first = records[0]
    example = load_tokenizer(run.spec.tokenizer_id, store).decode(first.completion_ids[0])
    note = unrewarded_note(store, ledger, run)
    assert note.startswith(
        f"rl run {run.spec.run_key}: none of its {len(rewards):,} sampled completions earned a reward, so every "
        "advantage was 0 and no step changed the weights. The reward rule (demo_problems: regex:Answer:\\s*(-?\\d+)) "
        "gives 1 for the problem's answer and 0.1 when a completion's last non-empty line is a whole match of "
        f"`Answer:\\s*(-?\\d+)`; step {first.step}, row {first.rows[0]} wrote {example[:160]!r}"
    )
    assert note.endswith("(README: rl on your own problems)")

"""Whether an rl run had anything to learn from: GRPO moves the weights only where a group's rewards differ, so
a run none of whose sampled completions earned any reward (no exact answer, no well-formed answer line) trained
on advantages that are all 0. That is no accounting fault (the checks pass) but a run that learned nothing;
this says so from the ledger's saved rollouts, with the reward rule's form and one completion the policy wrote,
and the settings that give a small policy a signal (README "rl on your own problems")."""

from __future__ import annotations

from ghostvis_core.data.bpe_tokenizer import load_tokenizer
from ghostvis_core.data.ledger import Ledger
from ghostvis_core.store import Store

EXAMPLE_CHARS = 160


def answer_form(rule: str) -> str:
    """What a completion's last non-empty line must be for the format reward under the rule (data/problems.py)."""
    if rule == "integer":
        return "an integer and nothing else (e.g. `42`)"
    if rule == "string":
        return "the answer itself"
    return f"a whole match of `{rule.removeprefix('regex:')}`"


def unrewarded_note(store: Store, ledger: Ledger, run) -> str | None:
    """For an rl run (`run`: verify/audit/invariants.StageRun) none of whose completions earned a reward: what
    the rule wants, an example completion and the fix; None when one did (or the run samples nothing)."""
    records = ledger.rollouts(run.chain)
    completions = [(r.step, row, ids) for r in records for row, ids in zip(r.rows, r.completion_ids)]
    if not completions or any(reward > 0 for r in records for reward in r.rewards):
        return None
    spec = run.spec
    rules = ", ".join(f"{source}: {rule}" for source, rule in sorted(spec.inputs.reward_rules.items()))
    forms = "; ".join(answer_form(rule) for rule in sorted(set(spec.inputs.reward_rules.values())))
    step, row, ids = completions[0]
    text = load_tokenizer(spec.tokenizer_id, store).decode(ids)
    example = text if len(text) <= EXAMPLE_CHARS else text[:EXAMPLE_CHARS] + "..."
    return (
        f"{spec.stage} run {spec.run_key}: none of its {len(completions):,} sampled completions earned a reward, so "
        f"every advantage was 0 and no step changed the weights. The reward rule ({rules}) gives 1 for the "
        f"problem's answer and 0.1 when a completion's last non-empty line is {forms}; step {step}, row {row} "
        f"wrote {example!r}. To give rl a signal, start it from a model that ends its replies on that line (sft "
        "on chats whose assistant turns end with it, then rl `<sft`), set grpo.stop_at_answer=true, and raise "
        "grpo.group_size and grpo.max_new_tokens (README: rl on your own problems)"
    )

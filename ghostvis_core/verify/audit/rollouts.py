"""The rl stage's rollouts, recounted by the audit's own code: the ledger's `rollouts` table keeps, per
part, rank and step, every completion the rank sampled (its global row, token ids, reward) and the
figures the trainer counted (generated and rewarded tokens, completions, correct ones).

Here each record's rows must be the rows the plan gives that rank at that step; the figures are
recounted from the saved completions, each reward is recomputed from the completion and the answer in
the problem's token file under the source's reward rule (the launch spec's `reward_rules`): 1 when the
rule's answer of the completion is the problem's, plus FORMAT_REWARD when the completion's last non-empty
line, stripped, is wholly an answer in the rule's form (an integer, any text, a whole match of the
pattern). The rules of data/problems.py are written here again, not imported, so a bug there cannot agree
with itself; rewarded tokens and correct completions are those of exact-answer completions. The prompts'
tokens are recounted from the token files, and the totals must equal the run record's, MLflow's and the
Dagster metadata's. `fed_content_matches_files` proves the saved completions are what the model was fed
(it rebuilds every row as prompt + saved completion).
"""

from __future__ import annotations

import re
from typing import Any

from ghostvis_core.counts import ROLLOUT_FIGURES, ROLLOUT_METRICS, TokenCounts
from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.ledger.records import PartRow, RolloutRow
from ghostvis_core.plan.batch import BatchPlan
from ghostvis_core.store import Store
from ghostvis_core.verify.audit.check_outcome import CheckOutcome
from ghostvis_core.verify.audit.rebuild import PlannedRows, micro_rows

NAME = "rollouts_recounted"
FORMAT_REWARD = 0.1  # the rl stage's reward for a well-formed final answer line (docs/glossary.md "rl reward")


def rule_answer(rule: str, text: str) -> str | None:
    """The answer a text gives under a reward rule: the last integer (`integer`, as an int's digits), the last
    non-empty line (`string`), the pattern's last match or its first group (`regex:<pattern>`); None: none."""
    if rule == "integer":
        found = re.findall(r"-?\d+", text)
        return str(int(found[-1])) if found else None
    if rule == "string":
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        return lines[-1] if lines else None
    found = [m.group(1) if m.re.groups else m.group(0) for m in re.finditer(rule.removeprefix("regex:"), text)]
    return found[-1].strip() if found else None


def recomputed_reward(rule: str, text: str, answer: str) -> float:
    """The rl reward of a completion's text, by the audit's own reading of it (module docstring)."""
    given, want = rule_answer(rule, text), answer.strip()
    if rule == "integer":
        exact = given is not None and re.fullmatch(r"-?\d+", want) is not None and int(given) == int(want)
    else:
        exact = given is not None and given == want
    last = next((line.strip() for line in reversed(text.splitlines()) if line.strip()), None)
    pattern = {"integer": r"-?\d+", "string": r"(?s).+"}.get(rule, rule.removeprefix("regex:"))
    return float(exact) + FORMAT_REWARD * (last is not None and re.fullmatch(pattern, last) is not None)


def recount_record(rows: PlannedRows, record: RolloutRow) -> tuple[list[int], int, list[int]]:
    """(the four rollout figures, prompt tokens fed, rows whose saved reward is not the recomputed one)
    of one (step, rank) record, from its saved completions and the token files."""
    figs, prompt_tokens, wrong = [0, 0, 0, 0], 0, []
    for g, ids, saved in zip(record.rows, record.completion_ids, record.rewards):
        s, j = rows.mixture.locate(g)
        src = rows.sources[s]
        stops = (src.tok.bos, src.tok.eot)
        answer = src.answer(j)
        r = recomputed_reward(src.rule, src.tok.decode([t for t in ids if t not in stops]), answer)
        if abs(r - float(saved)) > 1e-9:
            wrong.append(g)
        exact = r >= 1.0
        figs = [figs[0] + len(ids), figs[1] + (len(ids) if exact else 0), figs[2] + 1, figs[3] + exact]
        prompt_tokens += len(src.prompt(src.which(j)[1])[0])
    return figs, prompt_tokens, wrong


def record_problems(
    rows: PlannedRows, plan: dict[str, Any], chain: list[PartRow], records: list[RolloutRow]
) -> tuple[list[int], int, list[list[Any]]]:
    """Recounted totals, prompt tokens, and [step, rank, problem] for every (step, rank) of the chain."""
    batch = BatchPlan.of(plan)
    mbs, world, accum = batch.micro_batch_size, batch.world_size, batch.grad_accum_steps
    by = {(r.step, r.rank): r for r in records}
    totals, prompts, problems = [0, 0, 0, 0], 0, []
    for part in chain:
        for step in range(part.step_first, part.step_last + 1):
            for rank in range(world):
                r = by.get((step, rank))
                if r is None:
                    problems.append([step, rank, f"no rollouts recorded (part {part.part_id})"])
                    continue
                first = (step - 1) * batch.rows_per_step
                want = [g for m in range(accum) for g in micro_rows(first, m, rank, mbs, world)]
                if r.rows != want:
                    problems.append(
                        [step, rank, f"completions for rows {r.rows[:8]}..., the plan's rows are {want[:8]}..."]
                    )
                figs, p, wrong = recount_record(rows, r)
                totals, prompts = [a + b for a, b in zip(totals, figs)], prompts + p
                problems += [
                    [step, rank, f"{k} recorded {getattr(r, k):,}, recounted from the completions {v:,}"]
                    for k, v in zip(ROLLOUT_FIGURES, figs)
                    if getattr(r, k) != v
                ]
                problems += [
                    [step, rank, f"row {g}: saved reward is not the recomputed reward of its completion"]
                    for g in wrong[:5]
                ]
    return totals, prompts, problems


def copies(
    ledger_totals: list[int], record: dict[str, int], mlflow: dict[str, float], metadata: dict[str, Any] | None
) -> list[list[Any]]:
    """[figure, ledger, run record, MLflow, metadata] per rollout figure (metadata '-' without Dagster)."""
    out = []
    for k, v in zip(ROLLOUT_FIGURES, ledger_totals):
        m = mlflow.get(ROLLOUT_METRICS[k])
        out.append(
            [
                k,
                v,
                record.get(k),
                None if m is None else int(m),
                "-" if metadata is None else (None if metadata.get(k) is None else int(metadata[k])),
            ]
        )
    return out


def rollouts_recounted(
    store: Store, ledger: Ledger, run, mlflow: dict[str, float], metadata: dict[str, Any] | None
) -> CheckOutcome:
    """rl: generated/rewarded tokens recounted from the saved rollouts and prompts from the token files ==
    the ledger == the run record == MLflow == metadata. Any other stage: no rollouts in its parts."""
    spec = run.spec.to_dict()
    records = ledger.rollouts(run.chain)
    if spec["config"]["objective"] != "grpo":
        return CheckOutcome(
            NAME,
            not records,
            figures={"objective": spec["config"]["objective"], "rollout_records": len(records)},
            failures=[f"{len(records)} rollout records in the parts of a stage that samples nothing"]
            if records
            else [],
        )
    recount, prompts, problems = record_problems(PlannedRows(store, spec), spec["plan"], run.chain, records)
    ledger_totals = [sum(int(getattr(r, k)) for r in records) for k in ROLLOUT_FIGURES]
    table = copies(ledger_totals, run.record.generated, mlflow, metadata)
    failures = [f"{run.spec.stage} step {s} rank {r}: {p}" for s, r, p in problems[:50]]
    for (k, *vals), counted in zip(table, recount):
        if any(v != counted for v in vals if v != "-"):
            failures.append(f"{k}: recount {counted:,} != ledger/record/MLflow/metadata {vals}")
    chain = TokenCounts.total(p.counts for p in run.chain)
    if (chain.real_tokens, chain.loss_tokens) != (prompts + recount[0], recount[0]):
        failures.append(
            f"ledger real {chain.real_tokens:,} / loss {chain.loss_tokens:,} != prompt tokens from the files "
            f"{prompts:,} + generated {recount[0]:,} / generated {recount[0]:,}"
        )
    return CheckOutcome(
        NAME,
        not failures and bool(records),
        figures={
            **{f"{k}_recount": v for k, v in zip(ROLLOUT_FIGURES, recount)},
            **{f"{k}_ledger": v for k, v in zip(ROLLOUT_FIGURES, ledger_totals)},
            "prompt_tokens_recount": prompts,
            "prompt_tokens_ledger": chain.real_tokens - chain.loss_tokens,
            "rollout_records": len(records),
            "problems": len(problems),
        },
        tables={
            "copies": (["figure", "ledger", "run record", "mlflow", "metadata"], table),
            "problems": (["step", "rank", "problem"], problems[:200]),
        },
        failures=failures or ([] if records else ["the rl run has no rollouts in the ledger"]),
    )

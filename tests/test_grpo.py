"""The rl stage (GRPO): advantages, each reward rule through the trainer's reward and the audit's recount, the
loss and each step's TRL figures by hand; the trainer's rows and the audit's rebuilt rows agree on a problem token
file written by the tokenization's own encoder; the trainer's rollouts, rewards, advantages and loss raise a tiny
policy's held-out reward and format rate (and do not with the advantages' sign flipped); the launch carries each
source's reward rule; and an end-to-end smoke run of the `rl` asset through the real CLI whose checks pass, whose
generated tokens the audit recounts from the saved rollouts and whose MLflow step figures are recounted from
their rewards."""

from __future__ import annotations

import dataclasses
import itertools
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from datatrove.data import Document

from ghostvis_core.data.bpe_tokenizer import train_tokenizer
from ghostvis_core.data.catalog import save_manifest
from ghostvis_core.data.chat import render_prompt
from ghostvis_core.data.problems import closes_answer_line
from ghostvis_core.data.shard_manifest import Manifest
from ghostvis_core.data.shard_ref import ShardRef
from ghostvis_core.data.stream import SourceStream
from ghostvis_core.data.token_shard import token_dtype, write_token_shard
from ghostvis_core.data.tokenize_shards import encode_document, token_columns
from ghostvis_core.errors import GhostvisError
from ghostvis_core.launch.start import reward_rules
from ghostvis_core.plan import presets
from ghostvis_core.plan.batch import IGNORE_INDEX
from ghostvis_core.plan.config import GRPOConfig, ModelConfig, SourceWeight, StageConfig
from ghostvis_core.run.model.gpt import GPT
from ghostvis_core.run.train.dist import DistContext
from ghostvis_core.run.train.grpo import (
    FORMAT_REWARD,
    AnswerStop,
    GroupRows,
    GRPOBatch,
    RolloutLog,
    count_step,
    group_advantages,
    grpo_loss_sum,
    held_out_reward,
    kl_k3,
    reward,
    rollout_batch,
    row_ends,
    sample_group,
)
from ghostvis_core.store import FolderStore
from ghostvis_core.verify.audit.rebuild import PromptGroupRows, SourceFiles, rl_prompt
from ghostvis_core.verify.audit.rollouts import recomputed_reward
from ghostvis_core.verify.audit.token_files import TokenFile
from tests.conftest import run_cli

# (prompt, answer) as a problem source's rows give them
PROBLEMS = [
    ("Tom has 3 apples. He gets 4 more. How many apples does Tom have?", "7"),
    ("What is 12 - 5?", "7"),
    ("Compute 6 * 3.", "18"),
]
DEMO_RULE = r"regex:Answer:\s*(-?\d+)"  # the demo's (ghostvis_core/demo/tasks.py REWARD_RULES)


# ---------------------------------------------------------------- by hand


def test_advantages_are_the_reward_minus_the_group_mean_over_the_unbiased_group_std():
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))
    std1 = math.sqrt(4 * 0.25 / 3)  # mean 0.5, each deviation 0.5, n - 1 = 3
    assert adv[0].tolist() == pytest.approx(
        [0.5 / (std1 + 1e-4), -0.5 / (std1 + 1e-4), -0.5 / (std1 + 1e-4), 0.5 / (std1 + 1e-4)]
    )
    assert adv[1].tolist() == [0.0, 0.0, 0.0, 0.0]  # no signal in a group of equal rewards
    std3 = math.sqrt((0.75**2 + 3 * 0.25**2) / 3)
    assert adv[2, 0].item() == pytest.approx(0.75 / (std3 + 1e-4))
    assert adv[2, 1].item() == pytest.approx(-0.25 / (std3 + 1e-4))


def test_unscaled_advantages_keep_the_format_rewards_tenth_of_the_exact_answers_weight():
    """grpo.scale_rewards=none (Dr. GRPO): reward minus the group mean, not divided, so a group that differs only
    by the format reward (0.1 vs 0) moves the weights a tenth as much as one that differs by an exact answer (1.1
    vs 0.1); divided by the group's std both weigh the same."""
    rewards = torch.tensor([[0.1, 0.0, 0.0, 0.0], [1.1, 0.1, 0.1, 0.1]])
    unscaled, scaled = group_advantages(rewards, "none"), group_advantages(rewards)
    assert unscaled.flatten().tolist() == pytest.approx([0.075, -0.025, -0.025, -0.025, 0.75, -0.25, -0.25, -0.25])
    assert scaled[0].tolist() == pytest.approx(scaled[1].tolist(), rel=1e-2)


@pytest.mark.parametrize(
    "rule, completion, answer, expected",
    [
        # integer: the last integer, compared as a number; well-formed when the last line is one
        ("integer", "Step 1: 3 + 4 = 7.\n07", "7", 1.1),
        ("integer", "7 apples, then 2 more:\n9", "7", 0.1),  # a wrong answer on a well-formed line
        ("integer", "It is 7.\nI am sure.", "7", 1.0),  # right, but the last line is no integer
        ("integer", "So it is 7", "7", 1.0),  # right, but the line holds more than the integer
        ("integer", "-3", "-3", 1.1),
        # string: the last non-empty line, stripped
        ("string", "The capital of France?\n  Paris  \n", "Paris", 1.1),
        ("string", "Paris\nLyon", "Paris", 0.1),
        # regex: the last match, its group when it has one (the demo's `Answer: n`)
        (DEMO_RULE, "Step 1: 3 + 4 = 7.\nAnswer: 7", "7", 1.1),
        (DEMO_RULE, "Answer: 5\nStep 2: 5 + 2 = 7.\nAnswer: 70", "7", 0.1),
        (DEMO_RULE, "Answer: 7\nStep 2: 7 + 1 = 8.", "7", 1.0),  # the answer line does not end the reasoning
        ("regex:[A-E]", "The options... I pick\nC", "C", 1.1),
        (DEMO_RULE, "Answer: 7 apples 13 except", "7", 1.0),  # an answer in noise: no format reward
        # malformed: nothing the rule can read
        ("integer", "no number at all", "7", 0.0),
        (DEMO_RULE, "Step 1: 3 + 4 = 7.\nAnswer:", "7", 0.0),
        ("string", "", "Paris", 0.0),
    ],
)
def test_each_reward_rule_through_the_trainers_reward_and_the_audits_recount(rule, completion, answer, expected):
    assert FORMAT_REWARD == 0.1
    assert reward(rule, completion, answer) == pytest.approx(expected)
    assert recomputed_reward(rule, completion, answer) == pytest.approx(expected)  # the audit's own reading


@pytest.mark.parametrize(
    "rule, completion, closes",
    [
        (DEMO_RULE, "Step 1: 3 + 4 = 7.\nAnswer: 7\n", True),
        (DEMO_RULE, "Step 1: 3 + 4 = 7.\nAnswer: 1", False),  # the line may go on to `Answer: 12`
        (DEMO_RULE, "Answer: 7 apples\n", False),  # an answer amid other words closes no answer line
        (DEMO_RULE, "Step 1: 3 + 4 = 7.\n", False),
        ("integer", "So:\n-3\n\n", True),
        ("integer", "It is 7.\n", False),
        ("string", "Paris\n", True),
        ("string", "\n", False),
    ],
)
def test_sampling_stops_where_a_newline_closes_a_well_formed_answer_line(rule, completion, closes):
    assert closes_answer_line(rule, completion) is closes
    if closes:  # stopped there, the completion earns the format reward (its answer line is its last)
        assert reward(rule, completion, "0") == pytest.approx(FORMAT_REWARD)


def test_rewarded_tokens_and_correct_completions_count_exact_answers_only():
    log = RolloutLog({3: {"rows": [0, 1, 2], "completion_ids": [[5, 6, 7], [8, 9], [1]], "rewards": [1.1, 0.1, 0.0]}})
    assert log.figures(3) == [6, 3, 3, 1]  # generated, rewarded (the exact completion's 3), completions, exact
    (row,) = log.records("p0", "rl-r", 1)  # the ledger's rollouts row: the figures in their columns
    assert (row.rank, row.step, row.generated_tokens, row.rewarded_tokens, row.correct_completions) == (1, 3, 6, 3, 1)
    assert (row.rows, row.completion_ids, row.rewards) == ([0, 1, 2], [[5, 6, 7], [8, 9], [1]], [1.1, 0.1, 0.0])


def test_a_steps_reward_figures_are_trls_by_hand():
    """Per step (TRL's GRPO figures): the rewards' mean, the mean of the groups' (unbiased) standard deviations,
    the share of groups whose rewards are all equal (no gradient), and the share of exact answers."""
    log = RolloutLog(
        {2: {"rows": [0, 1, 2, 3], "completion_ids": [[5], [6, 7], [8], [9]], "rewards": [1.1, 0.1, 0.0, 0.0]}}
    )
    assert log.reward_sums(2, 2) == pytest.approx([1.2, math.sqrt(0.5), 2, 1])  # group 1: std of (1.1, 0.1)
    ctx = DistContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    total, figures = count_step(log, 2, {"generated_tokens": 10}, GRPOConfig(group_size=2), ctx, [])
    assert total["generated_tokens"] == 15 and total["completions"] == 4 and total["correct_completions"] == 1
    assert figures == pytest.approx(
        {
            "rl/reward_mean": 0.3,
            "rl/reward_std": math.sqrt(0.5) / 2,
            "rl/frac_reward_zero_std": 0.5,
            "rl/exact_rate": 0.25,
        }
    )
    assert count_step(log, 3, total, GRPOConfig(group_size=2), ctx, []) == (total, {})  # a step that sampled nothing


def test_a_steps_kl_is_its_micro_batches_kl_sums_over_its_generated_tokens_and_only_with_a_reference():
    """TRL's `kl` (logged only with a reference): the k3 sums the loss left on its micro-batches, over the step's
    generated tokens (5 here: completions of 1, 2, 1 and 1 tokens)."""
    log = RolloutLog(
        {2: {"rows": [0, 1, 2, 3], "completion_ids": [[5], [6, 7], [8], [9]], "rewards": [1.1, 0.1, 0.0, 0.0]}}
    )
    ctx = DistContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    batches = [GRPOBatch(None, None, [], None, kl_sum=torch.tensor(0.25)), GRPOBatch(None, None, [], None)]
    batches[1].kl_sum = torch.tensor(0.5, dtype=torch.bfloat16)  # as the loss sets it, in the model's dtype
    _, figures = count_step(log, 2, {}, GRPOConfig(group_size=2), ctx, batches)
    assert figures["rl/kl"] == pytest.approx(0.75 / 5)
    assert figures["rl/reward_mean"] == pytest.approx(0.3)  # the other figures as without a reference
    _, without = count_step(log, 2, {}, GRPOConfig(group_size=2), ctx, [GRPOBatch(None, None, [], None)])
    assert "rl/kl" not in without and set(without) == set(figures) - {"rl/kl"}


def test_the_loss_by_hand_with_and_without_the_kl_term():
    logps = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -9.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([2.0, -1.0])
    loss = grpo_loss_sum(logps, None, adv, mask, 0.0)
    assert loss.item() == pytest.approx(-(2.0 * 2) + 1.0 * 3)  # ratio 1: -sum_t A_i over generated tokens
    loss.backward()
    assert logps.grad.tolist() == [[-2.0, -2.0, 0.0], [1.0, 1.0, 1.0]]  # d/dlogp = -A_i on generated tokens

    ref = torch.tensor([[-1.5, -2.0, 0.0], [-0.3, -0.2, -9.0]])
    d = (ref - logps.detach()) * mask
    kl = sum(math.exp(x) - x - 1 for x, m in zip(d.flatten().tolist(), mask.flatten().tolist()) if m)
    with_kl = grpo_loss_sum(logps.detach(), ref, adv, mask, 0.1)
    assert with_kl.item() == pytest.approx(-4.0 + 3.0 + 0.1 * kl)
    assert kl == pytest.approx((math.exp(-0.5) + 0.5 - 1) + (math.exp(0.5) - 0.5 - 1))
    assert (kl_k3(logps.detach(), ref) * mask).sum().item() == pytest.approx(kl)  # the step's `rl/kl` numerator
    assert kl_k3(logps.detach(), logps.detach()).abs().max().item() == 0.0  # the policy is its reference: no KL


# ---------------------------------------------------------------- trainer rows == audit rows


@pytest.fixture(scope="module")
def shard(module_tmp):
    """A problem token file as tokenization writes it (its own encoder and columns): prompt, answer, prompt_len."""
    tok = train_tokenizer([f"{q}\nStep 1: so.\nAnswer: {a}" for q, a in PROBLEMS] * 30, vocab_size=320)
    encoded = [
        encode_document(tok, "problem", Document(text=q, id=str(i), metadata={"record": {"prompt": q, "answer": a}}))
        for i, (q, a) in enumerate(PROBLEMS)
    ]
    lists = {"tokens": ([len(e["tokens"]) for e in encoded], [np.asarray(e["tokens"], np.uint32) for e in encoded])}
    columns = token_columns(
        list(range(len(PROBLEMS))),
        lists,
        {"prompt_len": [e["prompt_len"] for e in encoded]},
        token_dtype(tok.vocab_size),
    )
    path = module_tmp("rl") / "problems-000.arrow"
    write_token_shard(path, columns)
    docs = [e["tokens"] for e in encoded]
    ref = ShardRef("problems/00000", "problems", "train", str(path), docs=len(docs), tokens=sum(map(len, docs)))
    return tok, docs, ref


def test_the_audit_rebuilds_a_problem_row_from_the_token_file(shard):
    tok, docs, ref = shard
    files = SourceFiles("problems", [TokenFile(Path(ref.path), ref.shard_id)], 7)
    audit = PromptGroupRows(files, 48, tok, {"group_size": 2, "max_new_tokens": 8, "prompt": "chat"}, "integer")
    for j in range(2 * len(docs)):
        k = audit.which(j)[1]
        question, answer = PROBLEMS[k]
        turn = render_prompt(tok, [{"role": "user", "content": question}])
        completion = tok.encode("Answer: 7") + [tok.eot]
        row = audit.row(j, completion)
        assert row.inputs[: len(turn) + len(completion)].tolist() == turn + completion
        assert row.targets[len(turn) - 1 : len(turn) - 1 + len(completion)].tolist() == completion
        assert audit.answer(j) == answer
        assert len(row.spans) == (j % 2 == 0)  # the problem's span rides on the group's first row
    text_prompt, cropped = rl_prompt(np.asarray(docs[0]), len(turn), tok, "text", 100)
    assert text_prompt.tolist() == [tok.bos, *tok.encode(PROBLEMS[0][0] + "\n")]  # `?\n` as a document has it
    assert tok.encode(PROBLEMS[0][0] + "\n")[-1] not in (tok.encode("?") + tok.encode("\n"))  # one merged token
    assert cropped == len(docs[0]) - len(turn)  # the answer and its <|eot|>, never fed


@pytest.mark.parametrize("form", ["chat", "text"])
def test_the_trainers_rows_equal_the_audits_rebuilt_rows(shard, form):
    tok, docs, ref = shard
    cfg = GRPOConfig(group_size=2, max_new_tokens=8, prompt=form)
    rows = GroupRows(SourceStream("problems", [ref], seed=7), 48, 7, tok, cfg, "integer")
    audit = PromptGroupRows(
        SourceFiles("problems", [TokenFile(Path(ref.path), ref.shard_id)], 7),
        48,
        tok,
        {"group_size": 2, "max_new_tokens": 8, "prompt": form},
        "integer",
    )
    for j in range(2 * len(docs)):
        completion = tok.encode(f"Answer: {j}") + [tok.eot]
        mine, theirs = rows.row(j, completion), audit.row(j, completion)
        assert (mine.inputs == theirs.inputs).all() and (mine.targets == theirs.targets).all()
        prompt = rows.problem_of_row(j).prompt
        last = tok.decode([int(prompt[-1])])
        assert last == "<|assistant|>" if form == "chat" else "\n" in last
        assert mine.real == len(prompt) + len(completion) and mine.loss == len(completion)
        assert mine.targets[len(prompt) - 1 : len(prompt) - 1 + len(completion)].tolist() == completion
        assert (mine.targets[len(prompt) - 1 + len(completion) :] == IGNORE_INDEX).all()
        assert len(mine.pieces) == (j % 2 == 0)  # the problem's piece rides on the group's first row
        assert rows.problem_of_row(j).answer == audit.answer(j)
        ids = np.asarray(docs[audit.which(j)[1]])
        n = int(TokenFile(Path(ref.path), ref.shard_id).prompt_len[audit.which(j)[1]])
        assert mine.cropped == (rl_prompt(ids, n, tok, form, 40)[1] if j % 2 == 0 else 0)
    assert sorted(rows.problem(k).answer for k in range(3)) == ["18", "7", "7"]


def test_the_answer_stop_holds_at_the_newline_after_the_answer_line_and_only_with_stop_at_answer(shard):
    tok, _, ref = shard
    stream = SourceStream("problems", [ref], seed=7)
    until = AnswerStop.of(GroupRows(stream, 48, 7, tok, GRPOConfig(group_size=2, stop_at_answer=True), DEMO_RULE))
    assert AnswerStop.of(GroupRows(stream, 48, 7, tok, GRPOConfig(group_size=2), DEMO_RULE)) is None
    ids = tok.encode("Step 1: so.\nAnswer: 12\nStep")
    stops = [k for k in range(1, len(ids) + 1) if until(ids[:k])]
    assert len(stops) == 1 and tok.decode(ids[: stops[0]]) == "Step 1: so.\nAnswer: 12\n"  # not at `Answer: 1`
    assert ids[stops[0] - 1] in until.newlines and tok.encode("\n")[0] in until.newlines


def test_a_completion_stopped_at_its_answer_line_is_the_unstopped_one_cut_there(shard):
    """With the answer stop in generate_rows's `ends`, a completion is the uninterrupted one (same generator) up to the
    token that closes its answer line, elsewhere all of it (a tiny random policy, rule `string`: any non-empty
    line is an answer line)."""
    tok, docs, ref = shard
    rows = GroupRows(SourceStream("problems", [ref], seed=7), 48, 7, tok, GRPOConfig(stop_at_answer=True), "string")
    until = AnswerStop.of(rows)
    policy, prompt, stops, cut = tiny_random_policy(tok), docs[0][:10], (tok.bos, tok.eot), 0
    for g in range(8):  # drawing ids below 32 only (the byte tokens, "\n" among them), so lines end often
        full, stopped = (
            policy.generate_rows(
                prompt, [torch.Generator().manual_seed(g)], 16, temperature=1.0, vocab=32, ends=row_ends(stops, u)
            )[0]
            for u in (None, until)
        )
        ends = [k for k in range(1, len(full) + 1) if until(full[:k])]
        assert stopped == (full[: ends[0]] if ends else full)
        cut += len(stopped) < len(full)
    assert cut >= 2


def test_a_group_sampled_together_is_each_row_sampled_alone_with_its_generator(shard):
    """rl samples a group's completions as one batch (rollout_batch): row g, seeded by (seed, g), draws what it
    draws on its own, whichever rows it shares the batch with, rows ending at different lengths (a resumed run
    samples what it would have sampled)."""
    tok, docs, ref = shard
    rows = GroupRows(SourceStream("problems", [ref], seed=7), 48, 7, tok, GRPOConfig(stop_at_answer=True), "string")
    cfg = GRPOConfig(group_size=8, max_new_tokens=16, temperature=1.0)
    policy, prompt, stops = tiny_random_policy(tok), np.asarray(docs[0][:10]), (tok.bos, tok.eot)
    together = sample_group(policy, prompt, cfg, stops, 3, range(40, 48), 32, AnswerStop.of(rows))
    alone = [sample_group(policy, prompt, cfg, stops, 3, [g], 32, AnswerStop.of(rows))[0] for g in range(40, 48)]
    halves = [
        c
        for part in (range(40, 44), range(44, 48))
        for c in sample_group(policy, prompt, cfg, stops, 3, part, 32, AnswerStop.of(rows))
    ]
    assert together == alone == halves
    assert len({len(c) for c in together}) >= 3 and len({tuple(c) for c in together}) == 8


def tiny_random_policy(tok) -> GPT:
    torch.manual_seed(0)
    cfg = ModelConfig(tok.vocab_size, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=32, max_seq_len=64)
    return GPT(cfg)


def grpo_trained(shard, steps: int, sign: float = 1.0) -> tuple[dict[str, float], dict[str, float]]:
    """The held-out figures (greedy and sampled, `held_out_reward`) of a tiny policy before and after `steps` GRPO
    steps on the shard's three problems under the `integer` rule, one generated token per completion, 8 per problem: the
    trainer's own rollouts, rewards, group advantages (times `sign`) and loss, with AdamW on its gradient. One
    thread, as a rank runs (a 16-wide model's matmuls on threads that wait for a busy machine's cores take 50x
    longer)."""
    tok, _, ref = shard
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        shape = dict(d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=32, max_seq_len=64)
        policy = GPT(ModelConfig(tok.vocab_size, **shape))
        cfg = GRPOConfig(group_size=8, max_new_tokens=1)
        rows = GroupRows(SourceStream("problems", [ref], seed=7), 48, 7, tok, cfg, "integer")
        ctx = DistContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
        before = held_out_reward(rows, policy, len(PROBLEMS), ctx, 7)
        opt = torch.optim.AdamW(policy.parameters(), lr=3e-2)
        per_step = cfg.group_size * len(PROBLEMS)
        for step in range(steps):
            batch = rollout_batch(rows, list(range(step * per_step, (step + 1) * per_step)), policy, seed=7)
            mask = batch.targets != IGNORE_INDEX
            logps = policy(batch.inputs, batch.targets, reduction="logprobs")
            loss = grpo_loss_sum(logps, None, sign * batch.advantages, mask, 0.0) / mask.sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return before, held_out_reward(rows, policy, len(PROBLEMS), ctx, 7)
    finally:
        torch.set_num_threads(threads)


def test_grpo_steps_raise_the_held_out_reward_and_format_rate_of_a_tiny_policy(shard):
    """The rl stage's learning signal end to end in one process: a random policy rarely answers with an integer
    line; the groups where one of the 8 samples does reward it, and after GRPO's steps greedy decoding answers every
    held-out problem with an integer (reward and format rate rise). With the advantages' sign flipped (the policy
    pushed away from its rewarded samples) the same steps teach nothing."""
    before, after = grpo_trained(shard, 10)
    assert (before["val/reward"], before["val/format_rate"], before["val/reward_problems"]) == (0.0, 0.0, 3)
    # every held-out answer an integer line (the format reward), none the right integer: 0.1 each
    assert (after["val/format_rate"], after["val/exact_accuracy"]) == (1.0, 0.0)
    assert after["val/reward"] == pytest.approx(FORMAT_REWARD)
    _, away = grpo_trained(shard, 10, sign=-1.0)
    assert (away["val/reward"], away["val/format_rate"]) == (0.0, 0.0)
    # sampled as rl samples (8 per problem, temperature 1, the same generators each time): integer lines among the
    # 24 samples 2 before, 3 after, 1 pushed away
    sampled = [r["val/sampled_format_rate"] * 24 for r in (before, after, away)]
    assert sampled == pytest.approx([2, 3, 1])
    assert after["val/sampled_reward"] == pytest.approx(FORMAT_REWARD * 3 / 24)


def test_the_launch_carries_each_sources_reward_rule_and_refuses_a_source_that_is_not_of_problems(tmp_path):
    store = FolderStore(tmp_path)
    save_manifest(store, Manifest("probs", "problem", [], reward="string"))
    save_manifest(store, Manifest("plain", "problem"))
    save_manifest(store, Manifest("prose", "text"))
    rl = presets.resolve("rl", "smoke")

    def reading(recipe: str, val: tuple[str, ...]) -> StageConfig:
        return dataclasses.replace(
            rl, data=dataclasses.replace(rl.data, recipe=(SourceWeight(recipe, 1.0),), val_sources=val)
        )

    assert reward_rules(store, reading("probs", ("plain",))) == {"plain": "integer", "probs": "string"}
    with pytest.raises(GhostvisError, match=r"^stage rl: source prose is a text source; grpo reads problems"):
        reward_rules(store, reading("prose", ()))
    assert rl.data.recipe[0].source == "demo_problems"


# ---------------------------------------------------------------- end to end


def stale_home(check: str, failure: str) -> bool:
    """A prebuilt home (GHOSTVIS_TEST_DEMO_HOME) tokenized before the decontamination gate has no n-gram
    records, which fails that blocking check for any stage; a home the suite builds has them."""
    return check == "no_eval_contamination" and "has no n-gram record in the ledger" in failure


def user_problems(folder: Path) -> str:
    """A user's problems in JSON Lines under their own column name (`question`), two train files and a
    validation file, and the `sources.yaml` that declares them: kind problem, reward integer."""
    import json
    import random

    rng = random.Random(3)
    folder.mkdir(parents=True)
    for name, n in (("a", 24), ("b", 24), ("val", 8)):
        pairs = [(rng.randint(2, 40), rng.randint(2, 40)) for _ in range(n)]
        lines = [json.dumps({"question": f"What is {a} + {b}?", "answer": a + b}) for a, b in pairs]
        (folder / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return f"""ops:
  shard_manifest:
    config:
      sources: []
      remote:
        - name: my_problems
          kind: problem
          listing: "{folder.as_uri()}/"
          columns: {{prompt: question}}
          reward: integer
          validation: ["val"]
"""


@pytest.mark.e2e
def test_the_rl_stage_runs_through_the_cli_on_a_users_problems_and_its_audit_recounts_the_generated_tokens(
    home_copy, tmp_path
):
    """The README's rl on your own problems, on a copy of the demo home: a JSON Lines problem source declared
    with a columns mapping and `reward: integer`, downloaded and tokenized by `ghostvis data`, then
    `ghostvis train rl --recipe my_problems=1.0 --set grpo.kl_beta=0.05` (the smoke preset); every check passes,
    the audit recounts every prompt and generated token and recomputes each reward under the source's rule, and
    each logged step's KL to the reference is in MLflow."""
    from mlflow.tracking import MlflowClient

    from ghostvis_core.counts import ROLLOUT_METRICS
    from ghostvis_core.data.catalog import load_manifest
    from ghostvis_core.data.ledger import Ledger
    from ghostvis_core.home import Home
    from ghostvis_core.launch.start import plan_run
    from ghostvis_core.run.track.mlflow_records import latest_metrics
    from ghostvis_core.runs.lookup import completed_runs
    from ghostvis_core.verify.audit.audit_report import audit_stage

    (config := tmp_path / "sources.yaml").write_text(user_problems(tmp_path / "problems"))
    select = ["-m", "ghostvis_pipeline.definitions", "--select", "shard_manifest", "-c", str(config)]
    run_cli(["dagster", "asset", "materialize", *select], home_copy)
    run_cli(["ghostvis", "data"], home_copy, timeout=900)
    train = ["ghostvis", "train", "rl", "--recipe", "my_problems=1.0", "--set", "grpo.kl_beta=0.05"]
    proc = run_cli(train, home_copy, timeout=900, check=False)
    h = Home(home_copy)
    ledger = Ledger.in_store(h.store)
    runs = completed_runs(h.store, "rl")
    assert runs, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = runs[-1]
    run_key = record.run_key
    spec = h.store.read_json("run_spec", "rl", run_key)
    assert spec["inputs"]["reward_rules"] == {"my_problems": "integer"}
    assert [s["shard_id"] for s in spec["train_shards"]["my_problems"]] == ["my_problems/a", "my_problems/b"]
    # the rule is in the run's identity: the same source under another rule is another run (this one is stale)
    overrides = {**presets.data_overrides({"my_problems": 1.0}, []), "grpo.kl_beta": 0.05}
    assert plan_run("rl", preset="smoke", overrides=overrides, home=h).base_key == run_key.rsplit("-r", 1)[0]
    manifest = load_manifest(h.store, "my_problems")
    manifest.reward = "string"
    save_manifest(h.store, manifest)
    assert plan_run("rl", preset="smoke", overrides=overrides, home=h).base_key != run_key.rsplit("-r", 1)[0]
    manifest.reward = "integer"
    save_manifest(h.store, manifest)
    result = audit_stage(h, ledger, "rl", run_key, None)
    checks = {c["name"]: c for c in result["checks"]}
    failures = [f for c in result["checks"] for f in c["failures"] if not stale_home(c["name"], f)]
    assert not failures and all(c["passed"] or c["name"] == "no_eval_contamination" for c in result["checks"]), failures
    assert proc.returncode == 0 or any(stale_home(n, f) for n, c in checks.items() for f in c["failures"])
    rollouts = ledger.rollouts(ledger.chain(run_key))
    recount = sum(len(c) for r in rollouts for c in r.completion_ids)
    ledger_generated = sum(r.generated_tokens for r in rollouts)
    figures = checks["rollouts_recounted"]["figures"]
    print(
        f"generated tokens: ledger {ledger_generated}, recount from rollouts {recount}; "
        f"rewarded {figures['rewarded_tokens_ledger']}; reward {record.evidence['reward'].before} -> "
        f"{record.evidence['reward'].after}"
    )
    assert (
        recount == ledger_generated == figures["generated_tokens_recount"] == record.generated["generated_tokens"] > 0
    )
    # smoke: 4 steps x 2 ranks x 4 rows, one completion per row, each at most 24 tokens
    assert len({(r.step, r.rank) for r in rollouts}) == 8 and record.generated["completions"] == 32
    assert ledger_generated <= 32 * 24
    mlflow = latest_metrics(h.mlflow_tracking_uri, record.mlflow_run_id)
    assert mlflow[ROLLOUT_METRICS["generated_tokens"]] == ledger_generated
    assert mlflow[ROLLOUT_METRICS["rewarded_tokens"]] == record.generated["rewarded_tokens"]
    assert checks["fed_content_matches_files"]["figures"]["rank_steps_checked"] == 8
    # the evidence the report card shows: the reward is its two parts (1 per exact answer, FORMAT_REWARD per
    # well-formed last line) before and after, and the run's MLflow evidence metrics are its after figures
    evidence = record.evidence
    # (sampled as rl samples, and the greedy completion's as context)
    assert set(evidence) == {f"{g}{n}" for g in ("", "greedy_") for n in ("reward", "exact_accuracy", "format_rate")}
    for g, when in itertools.product(("", "greedy_"), ("before", "after")):
        parts = getattr(evidence[f"{g}exact_accuracy"], when) + FORMAT_REWARD * getattr(
            evidence[f"{g}format_rate"], when
        )
        assert getattr(evidence[f"{g}reward"], when) == pytest.approx(parts)
    assert {n: mlflow[f"evidence/{n}"] for n in evidence} == {n: e.after for n, e in evidence.items()}
    # the last step's TRL figures in MLflow, recounted from the rewards its rollouts saved (groups of 2)
    last = max(r.step for r in rollouts)
    groups = [g for r in rollouts if r.step == last for g in zip(r.rewards[::2], r.rewards[1::2])]
    assert len(groups) == 4  # 2 ranks x 4 rows, 2 completions per prompt
    rewards = [x for g in groups for x in g]
    assert mlflow["rl/reward_mean"] == pytest.approx(sum(rewards) / 8)
    assert mlflow["rl/reward_std"] == pytest.approx(sum(abs(a - b) / math.sqrt(2) for a, b in groups) / 4)
    assert mlflow["rl/frac_reward_zero_std"] == sum(a == b for a, b in groups) / 4
    assert mlflow["rl/exact_rate"] == sum(x >= 1.0 for x in rewards) / 8
    # the KL to the reference (grpo.kl_beta > 0), TRL's `kl`: at step 1 the policy is the reference (none)
    client = MlflowClient(h.mlflow_tracking_uri)
    kl = {m.step: m.value for m in client.get_metric_history(record.mlflow_run_id, "rl/kl")}
    print(f"rl/kl per logged step: {kl}")
    assert {1, last} <= set(kl) and kl[1] == pytest.approx(0.0, abs=1e-6) and min(kl.values()) >= 0.0
    assert record.counts.loss_tokens == ledger_generated  # loss is carried by the generated tokens only

    # A completion saved shorter than it was fed (one token dropped): the rollouts no longer add up, the rows
    # rebuilt from them are not what the model received, and the recount from files + rollouts disagrees.
    tamper_first_completion(ledger.root / "rollouts" / "stage=rl" / f"run={run_key}")
    after = {c["name"]: c for c in audit_stage(h, ledger, "rl", run_key, None)["checks"]}
    assert not after["rollouts_recounted"]["passed"]
    assert any("generated_tokens recorded" in f for f in after["rollouts_recounted"]["failures"])
    assert not after["fed_content_matches_files"]["passed"]
    assert not after["tokens_recounted_from_files"]["passed"]
    assert after["tokens_recounted_from_files"]["figures"]["loss_tokens_recount"] == ledger_generated - 1


def tamper_first_completion(folder: Path) -> None:
    """Drop the last token of the first completion in the first rollout file of `folder` (one run's: the
    home copy holds the demo's rl run too, whose files may sort first)."""
    import json

    import pyarrow.parquet as pq

    from ghostvis_core.data.ledger.records import ROLLOUT_SCHEMA

    path = sorted(folder.rglob("*.parquet"))[0]
    rows = pq.read_table(path).to_pylist()
    ids = json.loads(rows[0]["completion_ids"])
    ids[0] = ids[0][:-1]
    rows[0]["completion_ids"] = json.dumps(ids)
    pq.write_table(pa.Table.from_pylist(rows, schema=ROLLOUT_SCHEMA), path)

"""GRPO (group-relative policy optimisation) on problems with a verifiable answer: the rl stage's rows,
rollouts, rewards, advantages and loss. The objective class that uses them is GRPOObjective
(ghostvis_core/run/train/objectives.py).

Rows (docs/glossary.md "rl row"): prompt p of the source's problems (seeded order per epoch, as dpo) is
global rows p x G .. p x G + G - 1, one per sampled completion, so the row rule, the shares and the
content digests work as for any stage. A problem's token file document is its chat prompt (ending at the
assistant marker, `prompt_len` tokens) then its answer as the reply (data/tokenize_shards.py). The prompt is read
as grpo.prompt says (`chat`: the rendered prompt as is; `text`: <|bos|> + the prompt's turns without the first
role marker and the closing <|eot|> + assistant marker, then a newline, for a base model), cut to
seq_len - max_new_tokens. A row is prompt + completion, padded: real = prompt + generated tokens, loss =
generated tokens; the problem's piece rides on the group's first row, with its tokens never fed (the answer,
held back as the label, and any prompt tokens cut) as cropped. Completion g is sampled from the current
policy with a generator seeded by (data.seed, g), so a resumed run samples what it would have sampled; it
ends at a stop token, at max_new_tokens, or (grpo.stop_at_answer) at the newline closing a well-formed answer
line: a policy that writes `Answer: 12` and runs on into another problem earns no format reward (its answer line
is not its last), so its groups have no signal; stopped there, the answer line it reached is its last.

Reward (`reward`): 1 when the completion's answer is the problem's under its source's reward rule
(`spec.inputs.reward_rules`, data/problems.py: integer, string or regex:<pattern>), plus FORMAT_REWARD (0.1)
when its last line alone gives an answer under the rule (DeepSeek-R1's and TRL's accuracy + format rewards):
a small policy rarely hits an exact answer, so without the format term every group's rewards are equal and
no step changes the weights. Advantage: the reward minus
its group's mean, over the group's (unbiased) standard deviation + 1e-4 (0 for a group of equal rewards);
with grpo.scale_rewards=none, not divided (Dr. GRPO).
Loss: per generated token, -A x ratio (ratio = p / p_sampled, 1 on-policy, with the gradient of log p),
plus kl_beta x the k3 estimate of KL(policy || reference); summed, and averaged over generated tokens by
the loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from ghostvis_core.counts import GRPO_STEP_METRICS, ROLLOUT_FIGURES, TokenCounts
from ghostvis_core.data.bpe_tokenizer import Tokenizer
from ghostvis_core.data.chat import ROLES
from ghostvis_core.data.ledger.records import RolloutRow
from ghostvis_core.data.loader import Batch, DocIndex, Row, rank_share
from ghostvis_core.data.problems import closes_answer_line, is_correct, well_formed
from ghostvis_core.data.shard_piece import Piece
from ghostvis_core.data.stream import SourceStream
from ghostvis_core.plan.batch import IGNORE_INDEX
from ghostvis_core.plan.config import GRPOConfig
from ghostvis_core.run.train.dist import DistContext, all_reduce_sum, on_device, summed_on_device

FORMAT_REWARD = 0.1
ADV_EPS = 1e-4
# Held-out samples draw as rows HELD_OUT_ROW + problem x G + j would: apart from every training row's generator
HELD_OUT_ROW = 2**40


def reward(rule: str, text: str, answer: str) -> float:
    """1 for the answer the rule accepts + FORMAT_REWARD for a well-formed last line (module docstring)."""
    return float(is_correct(rule, text, answer)) + FORMAT_REWARD * well_formed(rule, text)


def is_exact(r: float) -> bool:
    """A reward that includes the exact-answer 1 (the format term alone is at most FORMAT_REWARD)."""
    return r >= 1.0


def group_advantages(rewards: torch.Tensor, scale: str = "group") -> torch.Tensor:
    """(groups, G) rewards -> advantages: r - group mean, divided (scale `group`) by the group's std + 1e-4, std
    unbiased (as TRL's scale_rewards)."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    return centred / (rewards.std(dim=1, keepdim=True) + ADV_EPS) if scale == "group" else centred


def kl_k3(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Per token, the k3 estimate of KL(policy || reference): exp(ref - logp) - (ref - logp) - 1 (never negative;
    0 where the policy is the reference), the estimate TRL's GRPO uses."""
    d = ref_logps - logps
    return torch.exp(d) - d - 1


def grpo_loss_sum(
    logps: torch.Tensor, ref_logps: torch.Tensor | None, advantages: torch.Tensor, mask: torch.Tensor, kl_beta: float
) -> torch.Tensor:
    """Summed over generated tokens (mask): -A x exp(logp - sg(logp)) + kl_beta x kl_k3(logp, ref)."""
    ratio = torch.exp(logps - logps.detach())
    per_token = -advantages[:, None] * ratio
    if ref_logps is not None and kl_beta:
        per_token = per_token + kl_beta * kl_k3(logps, ref_logps)
    return (per_token * mask).sum()


def read_prompt(prompt: np.ndarray, tok: Tokenizer, form: str) -> np.ndarray:
    """A problem's rendered chat prompt as the policy reads it (grpo.prompt): `chat` as is, the form sft and dpo
    taught the policy to answer in; `text` <|bos|> + the turns without the first role marker and the closing
    <|eot|> + assistant marker, then a newline, tokenized as a document's `question\\n` (what a base model read)."""
    if form == "chat":
        return prompt
    first = next(m for m in (tok.marker(f"<|{r}|>") for r in ROLES) if prompt[1 : 1 + len(m)].tolist() == m)
    body = prompt[1 + len(first) : len(prompt) - 1 - len(tok.marker("<|assistant|>"))].tolist()
    # The text after the body's last special token is encoded again with the newline, as in a document: BPE
    # merges a closing `?` with the newline (`?\n`, one token), which appended alone the policy never read.
    specials = {tok.enc.encode_single_token(s) for s in tok.enc.special_tokens_set}
    cut = max((i + 1 for i, t in enumerate(body) if t in specials), default=0)
    return np.asarray([tok.bos, *body[:cut], *tok.encode(tok.decode(body[cut:]) + "\n")], np.int64)


class Problem(NamedTuple):
    prompt: np.ndarray  # the prompt as fed (read as grpo.prompt says, cut to seq_len - max_new_tokens)
    answer: str
    cropped: int  # never fed: the answer (the label) and any prompt tokens cut
    piece: Piece


class GroupRows:
    """rl rows: G rows per prompt (see the module docstring); completions are handed in."""

    def __init__(self, stream: SourceStream, seq_len: int, seed: int, tok: Tokenizer, cfg: GRPOConfig, rule: str):
        self.index = DocIndex(stream, seed)
        self.source, self.seq_len, self.tok, self.cfg, self.rule = stream.source, seq_len, tok, cfg, rule
        self.group_size, self.pad_id = cfg.group_size, tok.special("<|pad|>")
        self._problems: dict[tuple[int, int], Problem] = {}

    def problem(self, k: int, epoch: int = 0) -> Problem:
        """Problem k's prompt and answer (read from its token shard: the prompt's `prompt_len` tokens, then the
        answer's, closed by <|eot|>)."""
        if (k, epoch) not in self._problems:
            ref, shard, d = self.index.doc(k)
            ids = shard.doc_tokens(d).astype(np.int64)
            n = int(shard.doc_value("prompt_len", d))
            prompt = read_prompt(ids[:n], self.tok, self.cfg.prompt)
            keep = min(len(prompt), self.seq_len - self.cfg.max_new_tokens)
            answer = self.tok.decode(ids[n:-1].tolist())
            cropped = len(ids) - n + len(prompt) - keep
            self._problems[(k, epoch)] = Problem(prompt[:keep], answer, cropped, self.index.piece(k, epoch))
        return self._problems[(k, epoch)]

    def problem_of_row(self, j: int) -> Problem:
        epoch, p = divmod(j // self.group_size, len(self.index.docs))
        return self.problem(self.index.order(epoch)[p], epoch)

    def row(self, j: int, completion: Sequence[int] = ()) -> Row:
        """Row j with its completion (no completion: the prompt alone, as before sampling)."""
        pr = self.problem_of_row(j)
        seq = np.concatenate([pr.prompt, np.asarray(completion, np.int64)])
        inputs = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        targets = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        inputs[: len(seq)] = seq
        targets[len(pr.prompt) - 1 : len(seq) - 1] = completion
        first = j % self.group_size == 0
        return Row(
            inputs,
            targets,
            [pr.piece] if first else [],
            real=len(seq),
            pad=self.seq_len - len(seq),
            cropped=pr.cropped if first else 0,
        )

    def tokens_for_rows(self, n_rows: int) -> int:
        return int(n_rows / self.group_size / len(self.index.docs) * self.index.stream.total)

    @property
    def available_tokens(self) -> int:
        return self.index.stream.total


@dataclass
class GRPOBatch(Batch):
    """A micro-batch of rl rows with what the loss and the ledger need: each row's completion, reward
    and group-relative advantage."""

    completions: list[list[int]] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    advantages: torch.Tensor | None = None
    # kl_k3 summed over the generated tokens, on the device: set by the loss when a reference is loaded
    # (grpo.kl_beta > 0), read with the step's rollout figures (count_step)
    kl_sum: torch.Tensor | None = None


@dataclass(frozen=True)
class AnswerStop:
    """grpo.stop_at_answer: whether a completion just closed its answer line (data/problems.py
    `closes_answer_line`), the `ends` test GPT.generate_rows applies after each token."""

    rule: str
    tok: Tokenizer
    newlines: frozenset[int]  # the ids whose text ends a line: the only places an answer line can close

    @classmethod
    def of(cls, src: GroupRows) -> AnswerStop | None:
        if not src.cfg.stop_at_answer:
            return None
        ids = range(src.tok.vocab_size)
        return cls(src.rule, src.tok, frozenset(i for i in ids if src.tok.decode([i]).endswith("\n")))

    def __call__(self, completion: list[int]) -> bool:
        return completion[-1] in self.newlines and closes_answer_line(self.rule, self.tok.decode(completion))


def row_ends(stops: tuple[int, ...], until: AnswerStop | None) -> Callable[[list[int]], bool]:
    """GPT.generate_rows's `ends`: a completion ends after a stop token or, with `until`, its closed answer line."""
    return lambda row: row[-1] in stops or (until is not None and until(row))


def sample_group(
    policy,
    prompt: np.ndarray,
    cfg: GRPOConfig,
    stops: tuple[int, ...],
    seed: int,
    rows: Sequence[int],
    vocab: int,
    until: AnswerStop | None = None,
) -> list[list[int]]:
    """The completions of global rows `rows` (one group: they share the prompt), sampled together: row g at the
    temperature with a generator seeded by (seed, g), over the tokenizer's ids (never a padding id of the model's
    vocabulary), at most max_new_tokens, ending at a stop token or (`until`) the answer line's end."""
    device = policy.embed.weight.device
    gens = [torch.Generator(device=device).manual_seed(seed * 1_000_003 + g) for g in rows]
    return policy.generate_rows(
        prompt.tolist(),
        gens,
        cfg.max_new_tokens,
        temperature=cfg.temperature,
        vocab=vocab,
        ends=row_ends(stops, until),
    )


def rollout_batch(src: GroupRows, rows: list[int], policy, seed: int) -> GRPOBatch:
    """Sample each row's completion, a group at a time, reward it, and build the micro-batch (rows hold whole
    groups)."""
    stops, until = (src.tok.bos, src.tok.eot), AnswerStop.of(src)
    completions = []
    for first in range(0, len(rows), src.group_size):
        group = rows[first : first + src.group_size]
        prompt = src.problem_of_row(group[0]).prompt
        completions += sample_group(policy, prompt, src.cfg, stops, seed, group, src.tok.vocab_size, until)
    rewards = [
        reward(src.rule, src.tok.decode([t for t in c if t not in stops]), src.problem_of_row(g).answer)
        for g, c in zip(rows, completions)
    ]
    built = [src.row(g, c) for g, c in zip(rows, completions)]
    adv = group_advantages(torch.tensor(rewards).view(-1, src.group_size), src.cfg.scale_rewards).view(-1)
    return GRPOBatch(
        inputs=torch.from_numpy(np.stack([r.inputs for r in built])),
        targets=torch.from_numpy(np.stack([r.targets for r in built])),
        pieces=[p for r in built for p in r.pieces],
        counts=TokenCounts(
            sum(r.real for r in built),
            sum(r.pad for r in built),
            sum(r.loss for r in built),
            sum(r.cropped for r in built),
        ),
        rows=list(rows),
        completions=completions,
        rewards=rewards,
        advantages=adv,
    )


@dataclass
class RolloutLog:
    """Per step since the last checkpoint: this rank's rows, completions and rewards (the ledger's
    `rollouts` table, from which the audit recounts the generated tokens)."""

    steps: dict[int, dict[str, list]] = field(default_factory=dict)

    def add(self, step: int, batch: Batch) -> None:
        if isinstance(batch, GRPOBatch):
            s = self.steps.setdefault(step, {"rows": [], "completion_ids": [], "rewards": []})
            s["rows"] += batch.rows
            s["completion_ids"] += batch.completions
            s["rewards"] += batch.rewards

    def figures(self, step: int) -> list[int]:
        """generated tokens, rewarded tokens (of exact-answer completions), completions, exact-answer ones."""
        s = self.steps.get(step, {"completion_ids": [], "rewards": []})
        ids = s["completion_ids"]
        return [
            sum(len(c) for c in ids),
            sum(len(c) for c, r in zip(ids, s["rewards"]) if is_exact(r)),
            len(ids),
            sum(1 for r in s["rewards"] if is_exact(r)),
        ]

    def reward_sums(self, step: int, group_size: int) -> list[float]:
        """The step's sum of rewards, of its groups' (unbiased) reward standard deviations, its groups and the
        groups whose rewards are all equal (no advantage, no gradient); this rank's rows hold whole groups."""
        r = torch.tensor(self.steps.get(step, {}).get("rewards", []), dtype=torch.float64).view(-1, group_size)
        if not len(r):
            return [0.0, 0.0, 0, 0]
        return [r.sum().item(), r.std(dim=1).sum().item(), len(r), int((r == r[:, :1]).all(dim=1).sum())]

    def records(self, part_id: str, run_key: str, rank: int) -> list[RolloutRow]:
        """The ledger's `rollouts` rows of this rank in part `part_id` of run `run_key`: one per step."""
        return [
            RolloutRow(part_id, run_key, rank, step, *self.figures(step), **s) for step, s in sorted(self.steps.items())
        ]


def count_step(
    log: RolloutLog,
    step: int,
    generated: dict[str, int],
    cfg: GRPOConfig | None,
    ctx: DistContext,
    batches: Sequence[Batch],
) -> tuple[dict[str, int], dict[str, float]]:
    """The run's cumulative rollout figures after `step` (summed over ranks) and the step's sampled-reward figures
    (TRL's GRPO names: the rewards' mean, the mean of the groups' reward standard deviations, the share of groups
    with no reward variance, the share of exact answers and, with a reference, the mean KL per generated token).
    Called on every rank with the step's micro-batches; one host read, the KL sums joining the all-reduce from the
    device. A stage that samples nothing has no figures and no collective."""
    if step not in log.steps or cfg is None:
        return generated, {}
    figs = log.figures(step)
    kl = [b.kl_sum for b in batches if isinstance(b, GRPOBatch) and b.kl_sum is not None]
    host = on_device([*figs, *log.reward_sums(step, cfg.group_size)], ctx)
    values = torch.cat([host, torch.stack(kl).sum().double().reshape(1)]) if kl else host
    summed = summed_on_device(values, ctx).tolist()
    total = {k: generated.get(k, 0) + int(v) for k, v in zip(ROLLOUT_FIGURES, summed)}
    completions, (r_sum, std_sum, groups, zero_std) = max(1.0, summed[2]), summed[4:8]
    figures = [r_sum / completions, std_sum / max(1.0, groups), zero_std / max(1.0, groups), summed[3] / completions]
    if kl:  # the last name, logged only with a reference
        figures.append(summed[8] / max(1.0, summed[0]))
    return total, dict(zip(GRPO_STEP_METRICS, figures))


def scored_completion(src: GroupRows, out: list[int], answer: str, stops: tuple[int, ...]) -> list[float]:
    """A completion's reward, whether it is an exact answer, and whether its last line is a well-formed answer."""
    text = src.tok.decode([t for t in out if t not in stops])
    r = reward(src.rule, text, answer)
    return [r, float(is_exact(r)), float(well_formed(src.rule, text))]


@torch.no_grad()
def held_out_reward(src: GroupRows, policy, n_problems: int, ctx: DistContext, seed: int) -> dict[str, float]:
    """On the first n held-out problems (split over ranks), the mean reward, exact-answer accuracy and well-formed
    answer rate (the reward alone cannot tell format from accuracy) of the greedy completion (`val/reward`, ...)
    and of group_size completions sampled as rl samples them (`val/sampled_reward`, ...): pass@1 over k samples,
    as DeepSeek-R1 reports it. The sampled figures are the policy's expected reward, what GRPO raises; greedy
    decoding can stay put while it rises. Each sample's generator is fixed by (seed, problem, sample), apart from
    the training rows' (HELD_OUT_ROW), so an evaluation before and after training draws the same random numbers."""
    stops, until, g = (src.tok.bos, src.tok.eot), AnswerStop.of(src), src.group_size
    n = min(n_problems, len(src.index.docs))
    sums = [0.0] * 7  # greedy reward, exact, format; sampled reward, exact, format; problems
    for k in rank_share(n, ctx.rank, ctx.world_size):
        pr = src.problem(k)
        greedy = policy.generate_rows(
            pr.prompt.tolist(), [None], src.cfg.max_new_tokens, vocab=src.tok.vocab_size, ends=row_ends(stops, until)
        )[0]
        rows = range(HELD_OUT_ROW + k * g, HELD_OUT_ROW + (k + 1) * g)
        sampled = sample_group(policy, pr.prompt, src.cfg, stops, seed, rows, src.tok.vocab_size, until)
        scored = [scored_completion(src, out, pr.answer, stops) for out in sampled]
        figures = [*scored_completion(src, greedy, pr.answer, stops), *np.mean(scored, axis=0).tolist(), 1.0]
        sums = [a + b for a, b in zip(sums, figures)]
    s = all_reduce_sum(sums, ctx)
    per = max(1.0, s[6])
    return {
        "val/reward": s[0] / per,
        "val/exact_accuracy": s[1] / per,
        "val/format_rate": s[2] / per,
        "val/sampled_reward": s[3] / per,
        "val/sampled_exact_accuracy": s[4] / per,
        "val/sampled_format_rate": s[5] / per,
        "val/reward_problems": s[6],
    }

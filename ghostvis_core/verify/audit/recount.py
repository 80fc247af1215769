"""The four token figures recounted from the token files, outside the trainer.

The ledger's consumption rows say which token ranges of which shard a run read, per epoch; this
module opens each shard's token file through the store (local or S3), requires every range to lie in
the file and its row range to follow the stage's row rule, takes the union of the ranges per
(shard, epoch) and recounts real / loss / cropped tokens from the documents themselves:

- lm (windows of the token stream): every token read is one real position that carries loss;
  rows are never padded or cropped.
- sft (packed chats), dpo (preference pairs), vision_align (captions): ranges are whole documents;
  a document longer than a row is cut (the rest is cropped), loss follows the chat mask, the
  response, or the caption; an <|image|> token fills n_latents positions.
- grpo (rl): ranges are whole problems; each problem's prompt (its token file's first prompt_len tokens, read
  as grpo.prompt says) is fed to grpo.group_size rows (real, no loss), the rest of it (the answer, the label)
  is cropped; the generated tokens, real and
  carrying loss, are recounted from the completions the ledger's rollouts saved for the parts read.
Padding is what the rows' positions (steps x tokens_per_step) leave after the real tokens; lm rows
have none. A range read twice counts once here, so any double counting by the trainer shows.
"""

from __future__ import annotations

import numpy as np

from ghostvis_core.counts import TokenCounts
from ghostvis_core.data.bpe_tokenizer import load_tokenizer
from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.ledger.records import ConsumptionRow
from ghostvis_core.errors import GhostvisError
from ghostvis_core.runs.launch_spec import LaunchSpec
from ghostvis_core.store import Store
from ghostvis_core.store.files import sha256_file
from ghostvis_core.verify.audit.check_outcome import covered_twice, union
from ghostvis_core.verify.audit.rebuild import rl_prompt
from ghostvis_core.verify.audit.token_files import TokenFile


class FileRecount:
    """A run's token files, opened through the store once each (by the audit's own reader), and the
    stage's row rule."""

    def __init__(self, store: Store, spec: LaunchSpec, token_sha256: dict[tuple[str, str], str | None]):
        """`token_sha256`: per (shard id, raw content hash), the token file's hash the ledger recorded
        (None: not recorded). Each shard is read in the version the run's launch spec selected."""
        self.store, self.tokenizer_id, self.token_sha256 = store, spec.tokenizer_id, token_sha256
        self.content = spec.shard_versions()
        self.replaced: list[str] = []  # shards whose file is not the one the ledger recorded
        self.objective, self.seq_len = spec.config.objective, spec.config.batch.seq_len
        self.n_latents = spec.config.vision.n_latents if spec.config.vision else None
        self.tok = None if self.objective == "lm" else load_tokenizer(spec.tokenizer_id, store)
        self.image_id = None if self.tok is None else self.tok.special("<|image|>")
        self.grpo = spec.config.grpo
        self._open: dict[str, TokenFile] = {}

    def shard(self, shard_id: str) -> TokenFile:
        if shard_id not in self._open:
            content = self.content.get(shard_id, "")
            if not content:
                raise GhostvisError(
                    f"shard {shard_id} was consumed but the run's launch spec does not select it; "
                    f"the ledger's consumption rows are not this run's: re-materialize the stage"
                )
            path = self.store.fetch("token_shard", self.tokenizer_id, shard_id, content)
            want = self.token_sha256.get((shard_id, content))
            if want and sha256_file(path) != want:
                self.replaced.append(
                    f"token file of {shard_id} is not the one the ledger recorded (sha256 "
                    f"{want[:12]}...); re-materialize tokenized_shards partition {shard_id}"
                )
            self._open[shard_id] = TokenFile(path, shard_id)
        return self._open[shard_id]

    @property
    def opened(self) -> int:
        return len(self._open)

    def range_problem(self, r: ConsumptionRow) -> str | None:
        """Why a consumption row breaks the row rule, or None: the range must lie in the file, start
        and end on document boundaries unless the stage reads windows (lm), and name the raw rows
        whose documents hold it."""
        shard = self.shard(r.shard_id)
        a, b = int(r.tok_start), int(r.tok_end)
        where = f"{r.shard_id} epoch {r.epoch} tokens {a}..{b}"
        if not 0 <= a < b <= shard.num_tokens:
            return f"{where}: outside the file's {shard.num_tokens} tokens"
        if r.tokens != b - a:
            return f"{where}: tokens column says {r.tokens}, the range holds {b - a}"
        if self.objective != "lm" and not (_holds(shard.starts, a) and _holds(shard.starts, b)):
            return f"{where}: not whole documents (the {self.objective} rows read whole documents)"
        rows = shard.rows_of(a, b)
        if (r.row_start, r.row_end) != rows:
            return (
                f"{where}: rows {r.row_start}..{r.row_end} recorded, the file's documents are rows {rows[0]}..{rows[1]}"
            )
        return None

    def count(self, shard_id: str, a: int, b: int) -> TokenCounts:
        """real, loss and cropped tokens of tokens [a, b) of a shard under the stage's row rule (no pad)."""
        if self.objective == "lm":
            return TokenCounts(real_tokens=b - a, loss_tokens=b - a)
        shard = self.shard(shard_id)
        first = int(np.searchsorted(shard.starts, a, side="left"))
        last = int(np.searchsorted(shard.starts, b, side="left"))
        per_doc = {"sft": self._chat, "dpo": self._pair, "vision_align": self._caption, "grpo": self._prompt}[
            self.objective
        ]
        return TokenCounts.total(per_doc(shard, d) for d in range(first, last))

    def _chat(self, shard: TokenFile, d: int) -> TokenCounts:
        ids = shard.doc(d)
        has_image = self.n_latents and shard.image(d) is not None
        keep = np.where(ids == self.image_id, self.n_latents, 1) if has_image else np.ones(len(ids), np.int64)
        mask = np.repeat(shard.doc_mask(d), keep)
        real = min(len(mask), self.seq_len)
        return TokenCounts(real, 0, int((mask[1:real] > 0).sum()), len(mask) - real)

    def _pair(self, shard: TokenFile, d: int) -> TokenCounts:
        n_all = len(shard.doc(d))
        prompt, chosen = int(shard.prompt_len[d]), int(shard.chosen_len[d])
        out = TokenCounts()
        for length in (prompt + chosen, n_all - chosen):  # prompt + chosen, prompt + rejected: two rows
            n = min(length, self.seq_len)
            out = out + TokenCounts(n, 0, max(0, n - prompt), length - n)
        return out

    def _caption(self, shard: TokenFile, d: int) -> TokenCounts:
        tokens = shard.doc(d)  # a caption always has its image: every <|image|> expands
        ids = np.repeat(tokens, np.where(tokens == self.image_id, self.n_latents, 1))
        n = min(len(ids), self.seq_len)
        caption_start = int(np.nonzero(ids == self.image_id)[0][-1]) + 1
        return TokenCounts(n, 0, max(0, n - caption_start), len(ids) - n)

    def _prompt(self, shard: TokenFile, d: int) -> TokenCounts:
        ids = shard.doc(d)
        limit = self.seq_len - self.grpo.max_new_tokens
        fed, cropped = rl_prompt(ids, int(shard.prompt_len[d]), self.tok, self.grpo.prompt, limit)
        return TokenCounts(self.grpo.group_size * len(fed), 0, 0, cropped)

    def generated(self, consumption: list[ConsumptionRow]) -> TokenCounts:
        """rl: the tokens of every completion the rollouts of the consumption rows' parts saved (real,
        carrying loss)."""
        n = sum(len(c) for r in Ledger.in_store(self.store).rollouts(consumption) for c in r.completion_ids)
        return TokenCounts(real_tokens=n, loss_tokens=n)


def _holds(sorted_values: np.ndarray, x: int) -> bool:
    i = int(np.searchsorted(sorted_values, x))
    return i < len(sorted_values) and int(sorted_values[i]) == x


def recount(files: FileRecount, consumption: list[ConsumptionRow], positions: int) -> tuple[TokenCounts, int]:
    """(The four figures, tokens read twice) recounted over the union of `consumption` per (shard,
    epoch); `positions` (steps x tokens_per_step of the rows read) gives the padding of padded rows."""
    by_key: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for r in consumption:
        by_key.setdefault((r.shard_id, int(r.epoch)), []).append((int(r.tok_start), int(r.tok_end)))
    counts, twice = TokenCounts(), 0
    for (shard_id, _), ranges in sorted(by_key.items()):
        twice += sum(b - a for a, b in covered_twice(ranges))
        for a, b in union(ranges):
            counts = counts + files.count(shard_id, a, b)
    if files.objective == "grpo":
        counts = counts + files.generated(consumption)
    pad = 0 if files.objective == "lm" else positions - counts.real_tokens
    return TokenCounts(counts.real_tokens, pad, counts.loss_tokens, counts.cropped_tokens), twice

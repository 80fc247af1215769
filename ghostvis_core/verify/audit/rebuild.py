"""The rows a run's plan makes the model read, rebuilt by the audit from the launch spec and the token
files, with code of its own: it imports nothing from the loader, the objectives or the training loop
(tests/test_code_shape.py enforces that), so a bug there is not repeated here.

The row rule it implements (docs/glossary.md "row rule"):
- a step s reads global rows [(s - 1) x R, s x R), R = micro_batch_size x world_size x grad_accum;
  micro-batch m of rank r holds rows first + (m x world_size + r) x micro_batch_size + [0, micro_batch_size);
- the mixture: source i gets round(w_i x 1000) of every 1000 rows (largest remainder, ties to the
  earlier source), interleaved by smooth weighted round-robin (ties to the earlier source);
- lm: a source's shards in shard-id order (later epochs shuffled by Random("seed:source:epoch")) form
  one token stream; row j is the window [start + j x L, start + j x L + L + 1), inputs all but its
  last token, targets all but its first; start is where the lineage stopped reading the source;
- sft: documents in Random("seed:source:docs:epoch") order packed greedily into rows of L positions
  (a document longer than L is cut), <|image|> expanded to n_latents positions when the document has
  an image, targets on mask = 1 positions, pad elsewhere, document id per position;
- dpo: pair p is rows 2p (prompt + chosen) and 2p + 1 (prompt + rejected), targets on the response;
- vision_align: one caption per row, <|image|> expanded, targets on the caption;
- grpo (rl): problems (a problem source's token file: the chat prompt, `prompt_len` tokens, then the answer
  as its reply) in the sft order; prompt p is rows p x G .. p x G + G - 1 (G = grpo.group_size), each the
  problem's prompt (as is when grpo.prompt is `chat`; for `text` <|bos|> + the prompt without its first role
  marker and its closing <|eot|> + assistant marker, then a newline; cut to seq_len - grpo.max_new_tokens) +
  that row's completion as the ledger's rollouts saved it, targets on the completion; the problem's span
  rides on the group's first row.
"""

from __future__ import annotations

import io
import random
from fractions import Fraction
from typing import Any, NamedTuple

import numpy as np

from ghostvis_core import digest
from ghostvis_core.data.bpe_tokenizer import Tokenizer, load_tokenizer
from ghostvis_core.data.ledger import Ledger
from ghostvis_core.errors import GhostvisError
from ghostvis_core.store import Store
from ghostvis_core.verify.audit.token_files import TokenFile

IGNORE = -1  # the targets' value at positions without loss
PERIOD = 1000  # rows per mixture period


class Span(NamedTuple):
    """Tokens [tok_start, tok_end) of a shard, read in an epoch."""

    shard_id: str
    epoch: int
    tok_start: int
    tok_end: int


class PlannedRow(NamedTuple):
    inputs: np.ndarray
    targets: np.ndarray
    doc_ids: np.ndarray | None
    images: list[bytes]
    spans: list[Span]

    def digest(self) -> str:
        return digest.row_digest(self.inputs, self.targets, self.doc_ids)


def pixels(blob: bytes, size: int) -> np.ndarray:
    """An encoded image as the image encoder receives it: RGB, resized (bicubic) to size x size when it is
    not, (3, size, size) float32 in [0, 1]. The audit's own decoding, not the trainer's (run/model/vision.py
    decode_images); tests/test_content_proof.py holds the two to the same pixels."""
    from PIL import Image

    img = Image.open(io.BytesIO(blob)).convert("RGB")
    if img.size != (size, size):
        img = img.resize((size, size), Image.BICUBIC)
    return (np.asarray(img, dtype=np.float32) / 255.0).transpose(2, 0, 1)


def micro_rows(first_row: int, micro: int, rank: int, micro_batch_size: int, world_size: int) -> list[int]:
    start = first_row + (micro * world_size + rank) * micro_batch_size
    return list(range(start, start + micro_batch_size))


class Mixture:
    """Global row -> (source index, the source's row), by the rule in the module docstring."""

    def __init__(self, weights: list[float]):
        exact = [Fraction(w).limit_denominator(10**9) for w in weights]
        exact = [e * PERIOD / sum(exact) for e in exact]
        self.counts = [int(e) for e in exact]
        by_remainder = sorted(range(len(exact)), key=lambda i: (-(exact[i] - self.counts[i]), i))
        for i in by_remainder[: PERIOD - sum(self.counts)]:
            self.counts[i] += 1
        credit, self.pattern = [0] * len(exact), []
        for _ in range(PERIOD):
            credit = [c + n for c, n in zip(credit, self.counts)]
            best = min(range(len(credit)), key=lambda i: (-credit[i], i))
            credit[best] -= PERIOD
            self.pattern.append(best)
        self.before = [[0] * (PERIOD + 1) for _ in exact]  # rows of source i among the period's first r
        for i in range(len(exact)):
            for r, s in enumerate(self.pattern):
                self.before[i][r + 1] = self.before[i][r] + (s == i)

    def locate(self, g: int) -> tuple[int, int]:
        cycle, r = divmod(g, PERIOD)
        s = self.pattern[r]
        return s, cycle * self.counts[s] + self.before[s][r]

    def rows_before(self, g: int) -> list[int]:
        cycle, r = divmod(g, PERIOD)
        return [cycle * c + self.before[i][r] for i, c in enumerate(self.counts)]


class SourceFiles:
    """A source's token files in the order the row rule reads them."""

    def __init__(self, source: str, files: list[TokenFile], seed: int):
        self.source, self.seed = source, seed
        self.files = sorted(files, key=lambda f: f.shard_id)
        self.total = sum(f.num_tokens for f in self.files)
        self.docs = [(i, d) for i, f in enumerate(self.files) for d in range(f.num_docs)]
        self._doc_orders: dict[int, list[int]] = {}

    def stream_spans(self, a: int, b: int) -> list[Span]:
        """The stream's tokens [a, b), epochs included, as spans of shards."""
        out = []
        while a < b:
            epoch, off = divmod(a, self.total)
            order = list(range(len(self.files)))
            if epoch > 0:
                random.Random(f"{self.seed}:{self.source}:{epoch}").shuffle(order)
            for i in order:
                n = self.files[i].num_tokens
                if off < n:
                    take = min(n - off, b - a)
                    out.append(Span(self.files[i].shard_id, epoch, off, off + take))
                    a, off = a + take, 0
                    if a == b:
                        break
                else:
                    off -= n
        return out

    def stream_tokens(self, spans: list[Span]) -> np.ndarray:
        by_id = {f.shard_id: f for f in self.files}
        return np.concatenate([by_id[s.shard_id].tokens(s.tok_start, s.tok_end) for s in spans])

    def doc_order(self, epoch: int) -> list[int]:
        """The epoch's document order, shuffled once per epoch: every row of a document source asks for it,
        and shuffling the documents again for each row would cost the rows times the documents."""
        if epoch not in self._doc_orders:
            order = list(range(len(self.docs)))
            random.Random(f"{self.seed}:{self.source}:docs:{epoch}").shuffle(order)
            self._doc_orders[epoch] = order
        return self._doc_orders[epoch]

    def doc_span(self, k: int, epoch: int) -> Span:
        i, d = self.docs[k]
        return Span(self.files[i].shard_id, epoch, *self.files[i].doc_span(d))


class WindowRows:
    """lm rows: windows of the source's token stream."""

    def __init__(self, files: SourceFiles, seq_len: int, start: int):
        self.files, self.seq_len, self.start = files, seq_len, start

    def row(self, j: int) -> PlannedRow:
        a = self.start + j * self.seq_len
        spans = self.files.stream_spans(a, a + self.seq_len + 1)
        t = self.files.stream_tokens(spans)
        return PlannedRow(t[:-1], t[1:], None, [], self.row_spans(j))

    def row_spans(self, j: int) -> list[Span]:
        a = self.start + j * self.seq_len
        return self.files.stream_spans(a, a + self.seq_len)

    def spans_before(self, n_rows: int) -> list[Span]:
        return self.files.stream_spans(self.start, self.start + n_rows * self.seq_len)


class DocRows:
    """Rows of whole documents (sft, dpo, vision_align): the shared part, which document is where."""

    def __init__(self, files: SourceFiles, seq_len: int, pad_id: int, image_id: int, n_latents: int | None):
        self.files, self.seq_len, self.pad_id = files, seq_len, pad_id
        self.image_id, self.n_latents = image_id, n_latents

    def doc(self, k: int) -> tuple[TokenFile, int]:
        i, d = self.files.docs[k]
        return self.files.files[i], d

    def expanded(self, k: int) -> tuple[np.ndarray, np.ndarray, bytes | None]:
        """Document k's ids and mask with each <|image|> as n_latents positions (when it has an image)."""
        f, d = self.doc(k)
        ids, mask, image = f.doc(d), f.doc_mask(d), f.image(d)
        if image is None or not self.n_latents:
            return ids, mask, None
        times = np.where(ids == self.image_id, self.n_latents, 1)
        return np.repeat(ids, times), np.repeat(mask, times), image

    def blank(self) -> tuple[np.ndarray, np.ndarray]:
        return np.full(self.seq_len, self.pad_id, np.int64), np.full(self.seq_len, IGNORE, np.int64)

    def spans_before(self, n_rows: int) -> list[Span]:
        return [s for j in range(n_rows) for s in self.row_spans(j)]


class PackedChatRows(DocRows):
    """sft rows: conversations packed greedily, per epoch."""

    def __init__(self, *args):
        super().__init__(*args)
        self.packed: dict[int, list[list[int]]] = {}

    def pack(self, epoch: int) -> list[list[int]]:
        if epoch not in self.packed:
            rows, cur, used = [], [], 0
            for k in self.files.doc_order(epoch):
                n = min(len(self.expanded(k)[0]), self.seq_len)
                if cur and used + n > self.seq_len:
                    rows, cur, used = rows + [cur], [], 0
                cur, used = cur + [k], used + n
            self.packed[epoch] = rows + ([cur] if cur else [])
        return self.packed[epoch]

    def where(self, j: int) -> tuple[int, list[int]]:
        epoch = 0
        while j >= len(self.pack(epoch)):
            j, epoch = j - len(self.pack(epoch)), epoch + 1
        return epoch, self.pack(epoch)[j]

    def row_spans(self, j: int) -> list[Span]:
        epoch, docs = self.where(j)
        return [self.files.doc_span(k, epoch) for k in docs]

    def row(self, j: int) -> PlannedRow:
        epoch, docs = self.where(j)
        inputs, targets = self.blank()
        doc_ids, images, pos = np.full(self.seq_len, -1, np.int64), [], 0
        for slot, k in enumerate(docs):
            ids, mask, image = self.expanded(k)
            n = min(len(ids), self.seq_len - pos)
            inputs[pos : pos + n] = ids[:n]
            targets[pos : pos + n - 1] = np.where(mask[1:n] > 0, ids[1:n], IGNORE)
            doc_ids[pos : pos + n] = slot
            if image is not None and n < len(ids) and (ids[n:] == self.image_id).any():
                window = inputs[pos : pos + n]
                window[window == self.image_id] = self.pad_id  # the row cut the image: it is not shown
            elif image is not None:
                images.append(image)
            pos += n
        return PlannedRow(inputs, targets, doc_ids, images, self.row_spans(j))


class PairRows(DocRows):
    """dpo rows: 2p = prompt + chosen, 2p + 1 = prompt + rejected; the pair's span on the chosen row."""

    def pair(self, j: int) -> tuple[int, int, int]:
        pair, side = divmod(j, 2)
        epoch, p = divmod(pair, len(self.files.docs))
        return epoch, self.files.doc_order(epoch)[p], side

    def row_spans(self, j: int) -> list[Span]:
        epoch, k, side = self.pair(j)
        return [self.files.doc_span(k, epoch)] if side == 0 else []

    def row(self, j: int) -> PlannedRow:
        epoch, k, side = self.pair(j)
        f, d = self.doc(k)
        ids, n_prompt, n_chosen = f.doc(d), f.prompt_len[d], f.chosen_len[d]
        response = ids[n_prompt : n_prompt + n_chosen] if side == 0 else ids[n_prompt + n_chosen :]
        seq = np.concatenate([ids[:n_prompt], response])
        n = min(len(seq), self.seq_len)
        inputs, targets = self.blank()
        inputs[:n] = seq[:n]
        targets[n_prompt - 1 : n - 1] = seq[n_prompt:n]
        return PlannedRow(inputs, targets, None, [], self.row_spans(j))


class CaptionRows(DocRows):
    """vision_align rows: one image and its caption per row."""

    def which(self, j: int) -> tuple[int, int]:
        epoch, p = divmod(j, len(self.files.docs))
        return epoch, self.files.doc_order(epoch)[p]

    def row_spans(self, j: int) -> list[Span]:
        epoch, k = self.which(j)
        return [self.files.doc_span(k, epoch)]

    def row(self, j: int) -> PlannedRow:
        epoch, k = self.which(j)
        f, d = self.doc(k)
        ids = f.doc(d)
        seq = np.repeat(ids, np.where(ids == self.image_id, self.n_latents, 1))
        n = min(len(seq), self.seq_len)
        inputs, targets = self.blank()
        inputs[:n] = seq[:n]
        caption = int(np.nonzero(seq == self.image_id)[0][-1]) + 1
        targets[caption - 1 : n - 1] = seq[caption:n]
        return PlannedRow(inputs, targets, None, [f.image(d)], self.row_spans(j))


def rl_prompt(ids: np.ndarray, prompt_len: int, tok: Tokenizer, form: str, limit: int) -> tuple[np.ndarray, int]:
    """(The prompt as fed, the problem's tokens never fed) of an rl problem (module docstring): its first
    `prompt_len` tokens, as is (grpo.prompt `chat`) or for `text` without the opening role marker and the
    closing <|eot|> + assistant marker, after <|bos|> and before a newline (the text after the body's last special
    token encoded again with it, as a document has `?\\n`); cut to `limit` (seq_len -
    grpo.max_new_tokens); never fed: the answer and any prompt tokens cut."""
    prompt = ids[:prompt_len]
    if form == "text":
        roles = [tok.marker(f"<|{role}|>") for role in ("system", "user", "assistant")]
        opening = next(m for m in roles if prompt[1 : 1 + len(m)].tolist() == m)
        closing = 1 + len(tok.marker("<|assistant|>"))
        body = prompt[1 + len(opening) : prompt_len - closing].tolist()
        specials = {tok.enc.encode_single_token(name) for name in tok.enc.special_tokens_set}
        last = max((i + 1 for i, t in enumerate(body) if t in specials), default=0)  # text after it: re-encoded
        prompt = np.asarray([tok.bos, *body[:last], *tok.encode(tok.decode(body[last:]) + "\n")], np.int64)
    keep = min(len(prompt), limit)
    return prompt[:keep], len(ids) - prompt_len + len(prompt) - keep


class PromptGroupRows(DocRows):
    """grpo rows: G per prompt, each the prompt + its saved completion (see the module docstring)."""

    def __init__(self, files: SourceFiles, seq_len: int, tok: Tokenizer, grpo: dict[str, Any], rule: str):
        super().__init__(files, seq_len, tok.special("<|pad|>"), tok.special("<|image|>"), None)
        self.tok, self.group, self.max_new = tok, int(grpo["group_size"]), int(grpo["max_new_tokens"])
        self.form, self.rule = grpo["prompt"], rule  # rule: the source's reward rule (audit/rollouts.py reads it)
        for f in files.files:
            if f.prompt_len is None:
                raise GhostvisError(
                    f"rl source {files.source}: token file {f.shard_id} has no prompt_len, so it is not of problems "
                    f"(an rl run from before rl read problem sources); re-materialize the rl stage on a problem source"
                )

    def which(self, j: int) -> tuple[int, int, int]:
        """(epoch, document, sample) of row j."""
        p, sample = divmod(j, self.group)
        epoch, q = divmod(p, len(self.files.docs))
        return epoch, self.files.doc_order(epoch)[q], sample

    def prompt(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Problem k's prompt as fed, and its reply tokens (the answer, then <|eot|>)."""
        f, d = self.doc(k)
        ids, n = f.doc(d), int(f.prompt_len[d])
        prompt, _ = rl_prompt(ids, n, self.tok, self.form, self.seq_len - self.max_new)
        return prompt, ids[n:]

    def answer(self, j: int) -> str:
        """Row j's problem's answer: its reply's text without the closing <|eot|>."""
        reply = self.prompt(self.which(j)[1])[1]
        return self.tok.decode([int(t) for t in reply if t != self.tok.eot])

    def row_spans(self, j: int) -> list[Span]:
        epoch, k, sample = self.which(j)
        return [self.files.doc_span(k, epoch)] if sample == 0 else []

    def row(self, j: int, completion: list[int]) -> PlannedRow:
        prompt, _ = self.prompt(self.which(j)[1])
        seq = np.concatenate([prompt, np.asarray(completion, np.int64)])
        inputs, targets = self.blank()
        inputs[: len(seq)] = seq
        targets[len(prompt) - 1 : len(seq) - 1] = seq[len(prompt) :]
        return PlannedRow(inputs, targets, None, [], self.row_spans(j))


class PlannedRows:
    """Every global row of a run's plan, rebuilt from its launch spec (a dict, as stored) and the token
    files in the store."""

    def __init__(self, store: Store, spec: dict[str, Any]):
        cfg = spec["config"]
        self.objective, seq_len, seed = cfg["objective"], int(cfg["batch"]["seq_len"]), int(cfg["data"]["seed"])
        recipe = cfg["data"]["recipe"]
        self.mixture = Mixture([float(r["weight"]) for r in recipe])
        tok = load_tokenizer(spec["tokenizer_id"], store) if self.objective != "lm" else None
        n_latents = (cfg.get("vision") or {}).get("n_latents")
        self.image_size = (cfg.get("vision") or {}).get("image_size")
        offsets = (spec.get("inputs") or {}).get("stream_offsets", {})
        self.store, self.run_key, self._completions = store, spec["run_key"], None
        self._token_files: dict[str, TokenFile] | None = None
        self.sources = []
        for r in recipe:
            shards = spec["train_shards"].get(r["source"]) or []
            if not shards:
                raise GhostvisError(
                    f"stage {spec['stage']}: the launch spec selects no train shard of source "
                    f"{r['source']}; re-materialize the `{spec['stage']}` asset"
                )
            files = SourceFiles(
                r["source"],
                [
                    TokenFile(
                        store.fetch("token_shard", spec["tokenizer_id"], s["shard_id"], s["content_sha256"]),
                        s["shard_id"],
                    )
                    for s in shards
                ],
                seed,
            )
            if self.objective == "lm":
                self.sources.append(WindowRows(files, seq_len, int(offsets.get(r["source"], 0))))
                continue
            if self.objective == "grpo":
                rule = spec["inputs"]["reward_rules"][r["source"]]
                self.sources.append(PromptGroupRows(files, seq_len, tok, cfg["grpo"], rule))
                continue
            kind = {"sft": PackedChatRows, "dpo": PairRows, "vision_align": CaptionRows}[self.objective]
            self.sources.append(kind(files, seq_len, tok.special("<|pad|>"), tok.special("<|image|>"), n_latents))

    def row(self, g: int) -> PlannedRow:
        s, j = self.mixture.locate(g)
        if self.objective == "grpo":
            return self.sources[s].row(j, self.completion(g))
        return self.sources[s].row(j)

    def image_digests(self, g: int) -> list[str]:
        """The digests of row g's images as the image encoder must receive them (ghostvis_core/digest.py)."""
        return [digest.image_digest(pixels(im, self.image_size)) for im in self.row(g).images]

    def spans(self, g: int) -> list[Span]:
        """The shard spans row g reads, without building the row."""
        s, j = self.mixture.locate(g)
        return self.sources[s].row_spans(j)

    def token_file(self, shard_id: str) -> TokenFile:
        """The run's token file of a shard it trains on."""
        if self._token_files is None:
            self._token_files = {f.shard_id: f for src in self.sources for f in src.files.files}
        return self._token_files[shard_id]

    def completion(self, g: int) -> list[int]:
        """grpo: row g's completion as the run's rollouts (along its ledger chain) saved it; none saved: empty."""
        if self._completions is None:
            ledger = Ledger.in_store(self.store)
            rollouts = ledger.rollouts(ledger.chain(self.run_key))
            self._completions = {g_: ids for r in rollouts for g_, ids in zip(r.rows, r.completion_ids)}
        return self._completions.get(g, [])

    def spans_before(self, n_rows: int) -> list[Span]:
        """The shard spans rows [0, n_rows) read."""
        return [sp for src, n in zip(self.sources, self.mixture.rows_before(n_rows)) for sp in src.spans_before(n)]

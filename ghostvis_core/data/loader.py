"""The training loader: rows of seq_len positions from a source mixture, with exact accounting.

Rows are numbered globally. Optimizer step s reads rows [first, first + rows_per_step), where
`first` is the loader position saved in the checkpoint; micro-step m on rank r reads
first + (m x world_size + r) x micro_batch_size + [0, micro_batch_size). The position is therefore
independent of world size, a resume is a seek, and ranks never read the same row.

A MixtureSchedule maps global row g to (source, that source's row j); each source turns j into a
row by its own rule:
- LMRows (pretraining): the source's token stream cut into windows of seq_len + 1 with stride
  seq_len; documents are concatenated (each starts with <|bos|>), a long document continues in the
  next row (nothing cropped), no row is padded.
- ChatRows (SFT): whole conversations packed greedily into rows, padded at the end; attention
  stays inside a conversation (doc_ids); loss on assistant tokens only; a conversation longer
  than a row is cut and the rest counted as cropped.
- PreferenceRows (DPO): each pair is two rows (prompt+chosen, prompt+rejected), padded.
- CaptionRows (vision alignment): one image + caption per row; the <|image|> token expands to
  n_latents positions; loss on the caption.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch

from ghostvis_core.counts import TokenCounts
from ghostvis_core.data.shard_piece import Piece
from ghostvis_core.data.stream import SourceStream
from ghostvis_core.plan.batch import IGNORE_INDEX, BatchPlan
from ghostvis_core.plan.mixture import MixtureSchedule


@dataclass
class Row:
    inputs: np.ndarray  # (L,) int64
    targets: np.ndarray  # (L,) int64, IGNORE_INDEX where no loss
    pieces: list[Piece]
    real: int
    pad: int
    cropped: int = 0
    doc_ids: np.ndarray | None = None
    images: list[bytes] = field(default_factory=list)

    @property
    def loss(self) -> int:
        return int((self.targets != IGNORE_INDEX).sum())


@dataclass
class Batch:
    inputs: torch.Tensor
    targets: torch.Tensor
    pieces: list[Piece]
    counts: TokenCounts
    doc_ids: torch.Tensor | None = None
    images: list[bytes] = field(default_factory=list)
    # What the loss is averaged over in a step: loss tokens, or preference pairs for DPO.
    loss_units: int | None = None
    rows: list[int] = field(default_factory=list)  # the global rows it holds (the ledger's per-rank shares)

    @property
    def units(self) -> int:
        return self.counts.loss_tokens if self.loss_units is None else self.loss_units


def micro_batch_rows(first_row: int, micro: int, rank: int, plan: BatchPlan) -> range:
    start = first_row + (micro * plan.world_size + rank) * plan.micro_batch_size
    return range(start, start + plan.micro_batch_size)


class LMRows:
    """Pretraining rows: windows of the token stream, starting `start_token` into it (where the
    stage's lineage stopped reading this source, so a later stage continues, not re-reads)."""

    def __init__(self, stream: SourceStream, seq_len: int, start_token: int = 0):
        self.stream, self.seq_len, self.start = stream, seq_len, start_token
        self.source = stream.source

    def row(self, j: int) -> Row:
        L = self.seq_len
        a = self.start + j * L
        tokens, pieces = self.stream.read(a, a + L + 1)
        # The last token is only a target: it is the next row's first input and counted there.
        last = pieces[-1]
        if last.tokens == 1:
            pieces = pieces[:-1]
        else:
            pieces[-1] = Piece(last.source, last.shard_id, last.split, last.epoch, last.tok_start, last.tok_end - 1)
        t = tokens.astype(np.int64)
        return Row(t[:-1], t[1:], pieces, real=L, pad=0)

    def tokens_for_rows(self, n_rows: int) -> int:
        return n_rows * self.seq_len + (1 if n_rows else 0)

    @property
    def available_tokens(self) -> int:
        return self.stream.total - self.start


class DocIndex:
    """The documents of a source's shards, visited in a seeded shuffled order per epoch."""

    def __init__(self, stream: SourceStream, seed: int):
        self.stream = stream
        self.docs: list[tuple[int, int]] = []  # (shard index, doc index)
        for si, ref in enumerate(stream.refs):
            self.docs += [(si, d) for d in range(ref.docs)]
        self.seed = seed
        self._orders: dict[int, list[int]] = {}

    def order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            idx = list(range(len(self.docs)))
            random.Random(f"{self.seed}:{self.stream.source}:docs:{epoch}").shuffle(idx)
            self._orders[epoch] = idx
        return self._orders[epoch]

    def doc(self, k: int):
        si, d = self.docs[k]
        ref = self.stream.refs[si]
        return ref, self.stream.shard(ref), d

    def length(self, k: int) -> int:
        ref, shard, d = self.doc(k)
        a, b = shard.doc_span(d)
        return b - a

    def piece(self, k: int, epoch: int) -> Piece:
        ref, shard, d = self.doc(k)
        a, b = shard.doc_span(d)
        return Piece(ref.source, ref.shard_id, ref.split, epoch, a, b)


class ChatRows:
    """SFT rows: conversations packed greedily (in a seeded order per epoch) and padded. With a
    vision stack (n_latents set), an image chat's <|image|> expands and its image comes along."""

    def __init__(
        self,
        stream: SourceStream,
        seq_len: int,
        seed: int,
        pad_id: int,
        image_id: int | None = None,
        n_latents: int | None = None,
    ):
        self.index = DocIndex(stream, seed)
        self.source, self.seq_len, self.pad_id = stream.source, seq_len, pad_id
        self.image_id, self.n_latents = image_id, n_latents
        self._plans: dict[int, list[list[int]]] = {}

    def _doc(self, k: int) -> tuple[np.ndarray, np.ndarray, bytes | None]:
        """Token ids, loss mask and image of conversation k (image positions expanded)."""
        ref, shard, d = self.index.doc(k)
        ids = shard.doc_tokens(d).astype(np.int64)
        mask = shard.doc_list("mask", d) if "mask" in shard.extra else np.ones(len(ids), np.uint8)
        image = shard.doc_value("image", d) if "image" in shard.extra else None
        if image is None or not self.n_latents:
            return ids, mask, None
        keep = np.where(ids == self.image_id, self.n_latents, 1)
        return np.repeat(ids, keep), np.repeat(mask, keep), image

    def _length(self, k: int) -> int:
        n = self.index.length(k)
        if self.n_latents:
            ref, shard, d = self.index.doc(k)
            if "image" in shard.extra and shard.doc_value("image", d) is not None:
                n += int((shard.doc_tokens(d) == self.image_id).sum()) * (self.n_latents - 1)
        return n

    def plan(self, epoch: int) -> list[list[int]]:
        """Rows of one epoch as lists of document indices (computed from lengths only)."""
        if epoch not in self._plans:
            rows: list[list[int]] = []
            cur: list[int] = []
            used = 0
            for k in self.index.order(epoch):
                n = min(self._length(k), self.seq_len)
                if cur and used + n > self.seq_len:
                    rows.append(cur)
                    cur, used = [], 0
                cur.append(k)
                used += n
            if cur:
                rows.append(cur)
            self._plans[epoch] = rows
        return self._plans[epoch]

    def locate(self, j: int) -> tuple[int, int]:
        """Global row j -> (epoch, row within that epoch); epochs pack into different row counts."""
        epoch = 0
        while j >= len(self.plan(epoch)):
            j -= len(self.plan(epoch))
            epoch += 1
        return epoch, j

    def row(self, j: int) -> Row:
        epoch, j = self.locate(j)
        L = self.seq_len
        inputs, targets = blank_row(L, self.pad_id)
        doc_ids = np.full(L, -1, dtype=np.int64)
        pieces, images, pos, cropped = [], [], 0, 0
        for slot, k in enumerate(self.plan(epoch)[j]):
            ids, mask, image = self._doc(k)
            n = min(len(ids), L - pos)
            cropped += len(ids) - n
            inputs[pos : pos + n] = ids[:n]
            # Targets stop at the row's last token of the conversation: a cut-off rest is cropped,
            # never trained, not even as the last position's target.
            tgt = np.where(mask[1:n] > 0, ids[1:n], IGNORE_INDEX)
            targets[pos : pos + len(tgt)] = tgt
            doc_ids[pos : pos + n] = slot
            pieces.append(self.index.piece(k, epoch))
            if image is not None:
                if n < len(ids) and (ids[n:] == self.image_id).any():  # the row cut the image itself
                    inputs[pos : pos + n][inputs[pos : pos + n] == self.image_id] = self.pad_id
                else:
                    images.append(image)
            pos += n
        return Row(inputs, targets, pieces, real=pos, pad=L - pos, cropped=cropped, doc_ids=doc_ids, images=images)

    def tokens_for_rows(self, n_rows: int) -> int:
        """Tokens read by n_rows rows: whole epochs, plus the used fraction of the last one."""
        epoch, j = self.locate(n_rows) if n_rows else (0, 0)
        return int((epoch + j / len(self.plan(epoch))) * self.index.stream.total)

    @property
    def available_tokens(self) -> int:
        return self.index.stream.total


class PreferenceRows:
    """DPO rows: pair p is rows 2p (prompt + chosen) and 2p + 1 (prompt + rejected); targets
    cover the response only. Both rows carry the pair's piece once (on the chosen row)."""

    def __init__(self, stream: SourceStream, seq_len: int, seed: int, pad_id: int):
        self.index = DocIndex(stream, seed)
        self.source, self.seq_len, self.pad_id = stream.source, seq_len, pad_id

    def row(self, j: int) -> Row:
        n_pairs = len(self.index.docs)
        pair, side = divmod(j, 2)
        epoch, p = divmod(pair, n_pairs)
        k = self.index.order(epoch)[p]
        ref, shard, d = self.index.doc(k)
        ids = shard.doc_tokens(d).astype(np.int64)
        n_prompt, n_chosen = shard.doc_value("prompt_len", d), shard.doc_value("chosen_len", d)
        response = ids[n_prompt : n_prompt + n_chosen] if side == 0 else ids[n_prompt + n_chosen :]
        seq = np.concatenate([ids[:n_prompt], response])
        pieces = [self.index.piece(k, epoch)] if side == 0 else []
        return padded_row(seq, n_prompt, self.seq_len, self.pad_id, pieces)

    def tokens_for_rows(self, n_rows: int) -> int:
        return int(n_rows / 2 / len(self.index.docs) * self.index.stream.total)

    @property
    def available_tokens(self) -> int:
        return self.index.stream.total


class CaptionRows:
    """Vision-alignment rows: <|bos|> [n_latents image positions] caption <|eot|>, padded."""

    def __init__(self, stream: SourceStream, seq_len: int, seed: int, pad_id: int, image_id: int, n_latents: int):
        self.index = DocIndex(stream, seed)
        self.source, self.seq_len, self.pad_id = stream.source, seq_len, pad_id
        self.image_id, self.n_latents = image_id, n_latents

    def row(self, j: int) -> Row:
        epoch, p = divmod(j, len(self.index.docs))
        k = self.index.order(epoch)[p]
        ref, shard, d = self.index.doc(k)
        seq = expand_images(shard.doc_tokens(d).astype(np.int64), self.image_id, self.n_latents)
        caption_start = int(np.nonzero(seq == self.image_id)[0][-1]) + 1
        return padded_row(
            seq,
            caption_start,
            self.seq_len,
            self.pad_id,
            [self.index.piece(k, epoch)],
            images=[shard.doc_value("image", d)],
        )

    def tokens_for_rows(self, n_rows: int) -> int:
        return int(n_rows / len(self.index.docs) * self.index.stream.total)

    @property
    def available_tokens(self) -> int:
        return self.index.stream.total


def blank_row(seq_len: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """The inputs and targets of a row before anything is placed in it: all padding, no loss."""
    return np.full(seq_len, pad_id, dtype=np.int64), np.full(seq_len, IGNORE_INDEX, dtype=np.int64)


def padded_row(
    seq: np.ndarray, loss_start: int, seq_len: int, pad_id: int, pieces: list[Piece], images: list[bytes] | None = None
) -> Row:
    """One sequence alone in a row: cut at seq_len (the rest counted as cropped, never trained), padded
    after it, loss on the tokens from `loss_start` on. The one rule of every single-sequence row."""
    n = min(len(seq), seq_len)
    inputs, targets = blank_row(seq_len, pad_id)
    inputs[:n] = seq[:n]
    targets[loss_start - 1 : n - 1] = seq[loss_start:n]
    return Row(inputs, targets, pieces, real=n, pad=seq_len - n, cropped=len(seq) - n, images=images or [])


def expand_images(ids: np.ndarray, image_id: int, n_latents: int) -> np.ndarray:
    """Each <|image|> token becomes n_latents positions (filled with image embeddings later)."""
    return np.repeat(ids, np.where(ids == image_id, n_latents, 1))


class Batcher:
    """Assembles micro-batches from row sources mixed by weight (one source: weight 1)."""

    def __init__(self, sources: list, weights: list[float]):
        self.sources = sources
        self.schedule = MixtureSchedule(weights)

    def row(self, g: int) -> Row:
        s, j = self.schedule.locate(g)
        return self.sources[s].row(j)

    def batch(self, rows) -> Batch:
        got = [self.row(g) for g in rows]
        doc_ids = None
        if any(r.doc_ids is not None for r in got):
            doc_ids = torch.from_numpy(
                np.stack([r.doc_ids if r.doc_ids is not None else np.zeros(len(r.inputs), np.int64) for r in got])
            )
        return Batch(
            inputs=torch.from_numpy(np.stack([r.inputs for r in got])),
            targets=torch.from_numpy(np.stack([r.targets for r in got])),
            pieces=[p for r in got for p in r.pieces],
            counts=TokenCounts(
                sum(r.real for r in got), sum(r.pad for r in got), sum(r.loss for r in got), sum(r.cropped for r in got)
            ),
            doc_ids=doc_ids,
            images=[im for r in got for im in r.images],
            rows=list(rows),
        )

    def rows_per_source(self, n_rows: int) -> dict[str, int]:
        return {src.source: n for src, n in zip(self.sources, self.schedule.rows_before(n_rows))}


def rank_share(n: int, rank: int, world_size: int) -> range:
    """The items of 0..n-1 one rank evaluates: every world_size-th, from its rank on, so the ranks'
    shares cover each item exactly once and their sums all-reduce to the whole."""
    return range(rank, n, world_size)


def rank_batches(rs, n_rows: int, rank: int, world_size: int, rows_per_batch: int, group: int = 1, min_rows: int = 1):
    """This rank's share of the first n_rows rows of one row source, in batches of up to rows_per_batch
    rows: the held-out evaluation loop. Rows are dealt in groups of `group` consecutive rows (a
    preference pair stays together); a last batch of fewer than `min_rows` rows is left out."""
    batcher = Batcher([rs], [1.0])
    mine = rank_share(n_rows // group, rank, world_size)
    per = max(1, rows_per_batch // group)
    for i in range(0, len(mine), per):
        rows = [u * group + j for u in mine[i : i + per] for j in range(group)]
        if len(rows) >= min_rows:
            yield batcher.batch(rows)


@dataclass
class LoaderPosition:
    """Where the training loader is in the run's global row order: the rows consumed so far. Independent
    of world size, so a resume is a seek. Saved and restored like torchdata's StatefulDataLoader:
    `state_dict()` into the checkpoint's TrainState, `load_state_dict()` on resume."""

    rows: int = 0

    def advance(self, rows: int) -> None:
        self.rows += rows

    def state_dict(self) -> dict[str, int]:
        return {"rows": self.rows}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.rows = int(state["rows"])


@dataclass
class Consumption:
    """What one rank's loader delivered since the last flush: token counts, shard pieces and the
    global rows (so the ledger can show each rank's share, not only the sum)."""

    counts: TokenCounts = field(default_factory=TokenCounts)
    pieces: list[Piece] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)

    def add(self, batch: Batch) -> None:
        self.counts = self.counts + batch.counts
        self.pieces.extend(batch.pieces)
        self.rows.extend(batch.rows)


def merge_pieces(pieces: list[Piece]) -> tuple[list[Piece], int]:
    """Merge touching pieces per (shard, epoch); return the merged list and overlapping tokens.

    Overlap is a loader bug (two ranks or two micro-steps reading the same tokens); it is returned,
    not hidden, so the run can report it.
    """
    by_key: dict[tuple, list[Piece]] = defaultdict(list)
    for p in pieces:
        by_key[(p.source, p.shard_id, p.split, p.epoch)].append(p)
    merged: list[Piece] = []
    overlap = 0
    for key, group in sorted(by_key.items()):
        group.sort(key=lambda p: (p.tok_start, p.tok_end))
        cur = group[0]
        for p in group[1:]:
            if p.tok_start < cur.tok_end:
                overlap += min(p.tok_end, cur.tok_end) - p.tok_start
            if p.tok_start <= cur.tok_end:
                cur = Piece(*key, cur.tok_start, max(cur.tok_end, p.tok_end))
            else:
                merged.append(cur)
                cur = p
        merged.append(cur)
    return merged, overlap

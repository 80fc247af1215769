"""The training loader: packed rows from a source mixture, with exact token accounting.

Rows are numbered globally. Optimizer step s reads rows [first, first + rows_per_step), where
`first` is the loader position saved in the checkpoint; micro-step m on rank r reads
first + (m x world_size + r) x micro_batch_size + [0, micro_batch_size). The position is therefore
independent of world size, a resume is a seek, and ranks never read the same row.

Pretraining rows (LMBatcher) cut each source's token stream into windows of seq_len + 1 tokens with
stride seq_len: the documents are concatenated (each starts with <|bos|>), a document longer than a
row continues in the next row (nothing cropped), and no row is padded.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch

from ghostvis_core.budget import BatchPlan
from ghostvis_core.data.stream import MixtureSchedule, Piece, SourceStream
from ghostvis_core.model.gpt import IGNORE_INDEX


@dataclass
class Batch:
    inputs: torch.Tensor
    targets: torch.Tensor
    pieces: list[Piece]
    real_tokens: int
    pad_tokens: int
    loss_tokens: int
    cropped_tokens: int = 0
    doc_ids: torch.Tensor | None = None


def micro_batch_rows(first_row: int, micro: int, rank: int, plan: BatchPlan) -> range:
    start = first_row + (micro * plan.world_size + rank) * plan.micro_batch_size
    return range(start, start + plan.micro_batch_size)


class LMBatcher:
    """Rows of seq_len input tokens (+1 target) drawn from a weighted mixture of source streams."""

    def __init__(self, streams: list[SourceStream], weights: list[float], seq_len: int):
        self.streams = streams
        self.schedule = MixtureSchedule(weights)
        self.seq_len = seq_len

    def batch(self, rows: range) -> Batch:
        L = self.seq_len
        x = np.empty((len(rows), L + 1), dtype=np.int64)
        pieces: list[Piece] = []
        for i, g in enumerate(rows):
            s, j = self.schedule.locate(g)
            tokens, row_pieces = self.streams[s].read(j * L, j * L + L + 1)
            x[i] = tokens
            # The last token is only a target; it is the next row's first input, counted there.
            last = row_pieces[-1]
            if last.tokens == 1:
                row_pieces = row_pieces[:-1]
            else:
                row_pieces[-1] = Piece(last.source, last.shard_id, last.split, last.epoch, last.tok_start, last.tok_end - 1)
            pieces.extend(row_pieces)
        t = torch.from_numpy(x)
        n = len(rows) * L
        return Batch(t[:, :-1].contiguous(), t[:, 1:].contiguous(), pieces, real_tokens=n, pad_tokens=0, loss_tokens=n)

    def source_tokens(self, rows_consumed: int) -> dict[str, int]:
        """Tokens each source has delivered after `rows_consumed` global rows."""
        per = self.schedule.rows_before(rows_consumed)
        return {st.source: n * self.seq_len for st, n in zip(self.streams, per)}


def count_targets(targets: torch.Tensor) -> int:
    return int((targets != IGNORE_INDEX).sum())


@dataclass
class Consumption:
    """What one rank's loader delivered since the last flush: token counters and shard pieces."""

    real_tokens: int = 0
    pad_tokens: int = 0
    loss_tokens: int = 0
    cropped_tokens: int = 0
    pieces: list[Piece] = field(default_factory=list)

    def add(self, batch: Batch) -> None:
        self.real_tokens += batch.real_tokens
        self.pad_tokens += batch.pad_tokens
        self.loss_tokens += batch.loss_tokens
        self.cropped_tokens += batch.cropped_tokens
        self.pieces.extend(batch.pieces)

    def counters(self) -> list[int]:
        return [self.real_tokens, self.pad_tokens, self.loss_tokens, self.cropped_tokens]


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

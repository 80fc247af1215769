"""The content digest of what a rank feeds the model: the format both the trainer (which records it)
and the audit (which rebuilds every micro-batch from the token files and recomputes it) follow.

- a row: blake2b-64 of its input ids, then its targets (IGNORE_INDEX where no loss), then, for packed
  rows, the document id of every position (attention stays inside a document), each as
  little-endian int64;
- an image: blake2b-64 of its pixel tensor as the image encoder receives it: the shape (channels,
  height, width) as little-endian int64, then the values (RGB in [0, 1], resized to the model's
  image size) as little-endian float32;
- a micro-batch: blake2b-64 of its row digests, then its image hashes, in order;
- a step: blake2b-64 of its micro-batch digests, in order (the fold the ledger keeps per rank).

A digest is 16 hex characters. Defined once here so the two sides cannot drift; tests check the
format against hashlib directly, so a bug here cannot make both sides agree on nothing.
"""

from __future__ import annotations

import hashlib

import numpy as np


def _blake(chunks: list[bytes]) -> str:
    h = hashlib.blake2b(digest_size=8)
    for c in chunks:
        h.update(c)
    return h.hexdigest()


def _int64(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, dtype="<i8").tobytes()


def row_digest(inputs: np.ndarray, targets: np.ndarray, doc_ids: np.ndarray | None = None) -> str:
    return _blake([_int64(inputs), _int64(targets), *([] if doc_ids is None else [_int64(doc_ids)])])


def image_digest(pixels: np.ndarray) -> str:
    return _blake([_int64(np.asarray(pixels.shape)), np.ascontiguousarray(pixels, dtype="<f4").tobytes()])


def micro_digest(row_digests: list[str], image_hashes: list[str]) -> str:
    return _blake([bytes.fromhex(d) for d in row_digests] + [bytes.fromhex(h) for h in image_hashes])


def step_digest(micro_digests: list[str]) -> str:
    return _blake([bytes.fromhex(d) for d in micro_digests])

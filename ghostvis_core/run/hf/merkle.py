"""A Merkle tree over a stage's committed content digests, as Certificate Transparency builds it
(RFC 9162, section 2.1): sha256, a leaf hashed as 0x00 || leaf bytes, a node as 0x01 || left || right,
the left subtree holding the largest power of two of leaves smaller than the count. Anyone holding the
leaves in order rebuilds the root; anyone holding one leaf, its index, the tree size and the audit path
checks that leaf against the root alone, without the other leaves.
"""

from __future__ import annotations

import hashlib


def leaf_hash(data: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + data).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def _split(n: int) -> int:
    """The size of the left subtree of n > 1 leaves: the largest power of two smaller than n."""
    k = 1
    while k * 2 < n:
        k *= 2
    return k


def _root(hashes: list[bytes], lo: int, hi: int) -> bytes:
    if hi - lo == 1:
        return hashes[lo]
    k = _split(hi - lo)
    return node_hash(_root(hashes, lo, lo + k), _root(hashes, lo + k, hi))


def merkle_root(leaf_hashes: list[bytes]) -> bytes:
    """The root over these leaf hashes, in their order (no leaf: the sha256 of nothing)."""
    if not leaf_hashes:
        return hashlib.sha256(b"").digest()
    return _root(leaf_hashes, 0, len(leaf_hashes))


def audit_path(leaf_hashes: list[bytes], index: int) -> list[bytes]:
    """The sibling hashes from leaf `index` up to the root, the leaf's sibling first."""
    if not 0 <= index < len(leaf_hashes):
        raise IndexError(f"leaf {index} of a tree of {len(leaf_hashes)} leaves")
    path: list[bytes] = []
    lo, hi = 0, len(leaf_hashes)
    while hi - lo > 1:
        k = _split(hi - lo)
        if index < lo + k:
            path.append(_root(leaf_hashes, lo + k, hi))
            hi = lo + k
        else:
            path.append(_root(leaf_hashes, lo, lo + k))
            lo = lo + k
    return path[::-1]


def root_from_path(leaf: bytes, index: int, size: int, path: list[bytes]) -> bytes | None:
    """The root that leaf hash `leaf`, at `index` of a tree of `size` leaves, reaches along `path`
    (`audit_path`); None when the path's length does not fit the index and size."""
    if not 0 <= index < size:
        return None
    if size == 1:
        return leaf if not path else None
    if not path:
        return None
    k = _split(size)
    if index < k:
        below = root_from_path(leaf, index, k, path[:-1])
        return None if below is None else node_hash(below, path[-1])
    below = root_from_path(leaf, index - k, size - k, path[:-1])
    return None if below is None else node_hash(path[-1], below)

"""The Merkle tree over decision records: RFC 6962 / RFC 9162 §2.1 hashing, proofs, and their
verification.

Leaf *i* is the *i*-th record's line exactly as stored (canonical JSON, no newline):
``leaf = SHA-256(0x00 || line)``, ``node = SHA-256(0x01 || left || right)``; the root of ``n``
leaves is MTH(D[0:n]) (RFC 9162 §2.1.1). The tree keeps every complete subtree's hash
(``levels[k][i]`` covers leaves ``[i·2^k, (i+1)·2^k)``), so any RFC subtree hash, inclusion
proof (§2.1.3) or consistency proof (§2.1.4) costs O(log² n) hash look-ups.

Why our own code: Go's ``golang.org/x/mod/sumdb/tlog`` is the ecosystem's reference; there is no
maintained Python equivalent. ``make test`` builds a small Go program on tlog that checks our
roots and proofs (tests/integration/test_log_go_reference.py), and a naive recursive MTH from the
RFC's definition checks this module on generated trees (tests/unit/test_merkle.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

EMPTY_ROOT = hashlib.sha256(b"").digest()


def leaf_hash(line: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + line).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def _split(n: int) -> int:
    """The largest power of two smaller than ``n`` (``n`` > 1)."""
    return 1 << ((n - 1).bit_length() - 1)


_LEAF_PREFIX = hashlib.sha256(b"\x00")
_NODE_PREFIX = hashlib.sha256(b"\x01")


def leaf_hashes(lines: Sequence[bytes]) -> list[bytes]:
    """``leaf_hash`` of every line (a copied pre-fed hasher: no concatenation per line)."""
    copy = _LEAF_PREFIX.copy
    result = []
    for line in lines:
        hasher = copy()
        hasher.update(line)
        result.append(hasher.digest())
    return result


class HashLevel:
    """One level's hashes, 32 bytes each, in one contiguous buffer: ~32 bytes per entry instead
    of ~73 for a list of bytes objects (the tree of a long-running broker grows with its log)."""

    __slots__ = ("_data",)

    def __init__(self, hashes: Sequence[bytes] = ()) -> None:
        self._data = bytearray(b"".join(hashes))

    def __len__(self) -> int:
        return len(self._data) // 32

    def __getitem__(self, index: int) -> bytes:
        if not 0 <= index < len(self._data) // 32:
            raise IndexError(index)
        return bytes(self._data[index * 32 : index * 32 + 32])

    def append(self, digest: bytes) -> None:
        self._data += digest

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HashLevel) and self._data == other._data

    __hash__ = None  # type: ignore[assignment]


class MerkleTree:
    """Append-only; holds every complete subtree hash. Not thread-safe."""

    def __init__(self) -> None:
        self.levels: list[HashLevel] = [HashLevel()]

    @classmethod
    def from_lines(cls, lines: Sequence[bytes]) -> MerkleTree:
        """Build in bulk, level by level: the same complete subtrees ``append`` would keep, at a
        fraction of the cost (``bench/audit_bench.py``)."""
        tree = cls()
        level = leaf_hashes(lines)
        tree.levels = [HashLevel(level)]
        node = _NODE_PREFIX.copy
        while len(level) >= 2:
            parents = []
            for i in range(0, len(level) - 1, 2):
                hasher = node()
                hasher.update(level[i])
                hasher.update(level[i + 1])
                parents.append(hasher.digest())
            tree.levels.append(HashLevel(parents))
            level = parents
        return tree

    @property
    def size(self) -> int:
        return len(self.levels[0])

    def append_leaf_hash(self, leaf: bytes) -> int:
        """Add a leaf; returns its index."""
        index = len(self.levels[0])
        self.levels[0].append(leaf)
        level, position = 0, index
        while position % 2 == 1:  # a right child completes its parent
            parent = node_hash(self.levels[level][position - 1], self.levels[level][position])
            level += 1
            if len(self.levels) == level:
                self.levels.append(HashLevel())
            self.levels[level].append(parent)
            position //= 2
        return index

    def append(self, line: bytes) -> int:
        return self.append_leaf_hash(leaf_hash(line))

    def root(self, size: int | None = None) -> bytes:
        """MTH(D[0:size]); the empty tree's root is SHA-256 of nothing."""
        n = self.size if size is None else size
        if not 0 <= n <= self.size:
            raise ValueError(f"tree size {n} is not in 0..{self.size}")
        return EMPTY_ROOT if n == 0 else self._hash(0, n)

    def _hash(self, start: int, end: int) -> bytes:
        width = end - start
        if width & (width - 1) == 0 and start % width == 0:  # a complete, aligned subtree
            return self.levels[width.bit_length() - 1][start // width]
        k = _split(width)
        return node_hash(self._hash(start, start + k), self._hash(start + k, end))

    def inclusion_proof(self, index: int, size: int) -> list[bytes]:
        """PATH(index, D[0:size]) (RFC 9162 §2.1.3.1), bottom-up."""
        if not 0 <= index < size <= self.size:
            raise ValueError(f"no leaf {index} in a tree of size {size}")
        return self._path(index, 0, size)

    def _path(self, m: int, start: int, end: int) -> list[bytes]:
        n = end - start
        if n == 1:
            return []
        k = _split(n)
        if m < k:
            return [*self._path(m, start, start + k), self._hash(start + k, end)]
        return [*self._path(m - k, start + k, end), self._hash(start, start + k)]

    def consistency_proof(self, first: int, second: int) -> list[bytes]:
        """PROOF(first, D[0:second]) (RFC 9162 §2.1.4.1)."""
        if not 0 < first <= second <= self.size:
            raise ValueError(f"no consistency proof from {first} to {second}")
        return self._subproof(first, 0, second, complete=True)

    def _subproof(self, m: int, start: int, end: int, *, complete: bool) -> list[bytes]:
        n = end - start
        if m == n:
            return [] if complete else [self._hash(start, end)]
        k = _split(n)
        if m <= k:
            left = self._subproof(m, start, start + k, complete=complete)
            return [*left, self._hash(start + k, end)]
        right = self._subproof(m - k, start + k, end, complete=False)
        return [*right, self._hash(start, start + k)]


def verify_inclusion(
    leaf: bytes, index: int, size: int, proof: Sequence[bytes], root: bytes
) -> bool:
    """RFC 9162 §2.1.3.2: does ``proof`` show leaf ``index`` of ``size`` leaves under ``root``?"""
    if not 0 <= index < size:
        return False
    fn, sn, r = index, size - 1, leaf
    for p in proof:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            if not fn & 1:
                while fn and not fn & 1:
                    fn >>= 1
                    sn >>= 1
        else:
            r = node_hash(r, p)
        fn >>= 1
        sn >>= 1
    return sn == 0 and r == root


def verify_consistency(
    first: int, second: int, first_root: bytes, second_root: bytes, proof: Sequence[bytes]
) -> bool:
    """RFC 9162 §2.1.4.2: is the tree of size ``first`` a prefix of the one of size ``second``?"""
    if not 0 < first <= second:
        return False
    if first == second:
        return not proof and first_root == second_root
    if not proof:
        return False
    path = list(proof)
    if first & (first - 1) == 0:  # a power of two: the first root is the first proof node
        path.insert(0, first_root)
    fn, sn = first - 1, second - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            fr = node_hash(c, fr)
            sr = node_hash(c, sr)
            if not fn & 1:
                while fn and not fn & 1:
                    fn >>= 1
                    sn >>= 1
        else:
            sr = node_hash(sr, c)
        fn >>= 1
        sn >>= 1
    return sn == 0 and fr == first_root and sr == second_root


class CompactRange:
    """The roots of the complete subtrees that cover leaves ``[0, size)``, largest first (one per
    set bit of ``size``): enough to go on appending leaves and to compute the root of every
    later size without keeping a leaf. A monitor keeps one per log, so the records a broker
    serves it are checked against the signed checkpoint's root, not trusted (the "compact
    range" of Certificate Transparency monitors and Trillian)."""

    def __init__(self, size: int = 0, hashes: Sequence[bytes] = ()) -> None:
        """Raises: ValueError when ``hashes`` is not one 32-byte hash per set bit of ``size``."""
        if size < 0 or len(hashes) != size.bit_count() or any(len(h) != 32 for h in hashes):
            raise ValueError(f"a compact range of {size} leaves has {size.bit_count()} hashes")
        self.size = size
        self.hashes = list(hashes)

    def append(self, leaf: bytes) -> None:
        """Add leaf ``size`` (its RFC 9162 leaf hash): a right child completes its parent."""
        self.hashes.append(leaf)
        self.size += 1
        merges = (self.size & -self.size).bit_length() - 1  # trailing zero bits of the size
        for _ in range(merges):
            right = self.hashes.pop()
            self.hashes.append(node_hash(self.hashes.pop(), right))

    def root(self) -> bytes:
        """MTH(D[0:size]): the complete subtrees folded from the right (RFC 9162 §2.1.1 splits
        off the largest power of two first)."""
        if not self.hashes:
            return EMPTY_ROOT
        root = self.hashes[-1]
        for left in reversed(self.hashes[:-1]):
            root = node_hash(left, root)
        return root

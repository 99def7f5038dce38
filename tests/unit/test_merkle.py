"""The Merkle tree against RFC 9162's definitions, on every tree size up to 70."""

from __future__ import annotations

import hashlib

import pytest

from broker.crypto.merkle import (
    EMPTY_ROOT,
    CompactRange,
    MerkleTree,
    leaf_hash,
    node_hash,
    verify_consistency,
    verify_inclusion,
)

LINES = [f'{{"record":{i}}}'.encode() for i in range(70)]


def mth(lines: list[bytes]) -> bytes:
    """RFC 9162 §2.1.1, literally: the reference the tree is checked against."""
    if not lines:
        return hashlib.sha256(b"").digest()
    if len(lines) == 1:
        return leaf_hash(lines[0])
    k = 1 << ((len(lines) - 1).bit_length() - 1)
    return node_hash(mth(lines[:k]), mth(lines[k:]))


@pytest.fixture(scope="module")
def tree() -> MerkleTree:
    built = MerkleTree()
    for line in LINES:
        built.append(line)
    return built


def test_roots_match_the_definition_for_every_size(tree: MerkleTree) -> None:
    assert tree.root(0) == EMPTY_ROOT
    for n in range(1, len(LINES) + 1):
        assert tree.root(n) == mth(LINES[:n]), n


def test_every_inclusion_proof_verifies_and_only_for_its_leaf(tree: MerkleTree) -> None:
    for n in range(1, len(LINES) + 1):
        root = tree.root(n)
        for m in range(n):
            proof = tree.inclusion_proof(m, n)
            assert verify_inclusion(leaf_hash(LINES[m]), m, n, proof, root), (m, n)
            assert not verify_inclusion(leaf_hash(b"forged"), m, n, proof, root)
            if n > 1:
                assert not verify_inclusion(leaf_hash(LINES[m]), (m + 1) % n, n, proof, root)


def test_every_consistency_proof_verifies_and_catches_a_rewrite(tree: MerkleTree) -> None:
    rewritten = MerkleTree()
    for i, line in enumerate(LINES):
        rewritten.append(b"rewritten" if i == 3 else line)
    for n in range(1, len(LINES) + 1):
        for m in range(1, n + 1):
            proof = tree.consistency_proof(m, n)
            assert verify_consistency(m, n, tree.root(m), tree.root(n), proof), (m, n)
            if m > 3:  # the first tree already held the changed record: no proof can link them
                assert not verify_consistency(m, n, tree.root(m), rewritten.root(n), proof)


def test_proofs_refuse_impossible_sizes(tree: MerkleTree) -> None:
    with pytest.raises(ValueError, match="no leaf 5"):
        tree.inclusion_proof(5, 5)
    with pytest.raises(ValueError, match="no consistency proof"):
        tree.consistency_proof(0, 3)
    with pytest.raises(ValueError, match="tree size"):
        tree.root(len(LINES) + 1)
    assert not verify_consistency(3, 5, tree.root(3), tree.root(5), [])


def test_bulk_build_equals_appending(tree: MerkleTree) -> None:
    for n in (0, 1, 2, 3, 5, 8, 13, 64, 70):
        bulk = MerkleTree.from_lines(LINES[:n])
        assert bulk.root() == tree.root(n)
        assert bulk.levels == MerkleTree.from_lines(LINES[:n]).levels
        if n > 1:
            assert bulk.inclusion_proof(n - 1, n) == tree.inclusion_proof(n - 1, n)
            appended = MerkleTree()
            for line in LINES[:n]:
                appended.append(line)
            assert [level for level in bulk.levels if level] == [
                level for level in appended.levels if level
            ]


def test_a_compact_range_extends_from_any_size_to_the_definitions_root() -> None:
    """A monitor's state: the range saved at size m, extended leaf by leaf, gives MTH of every
    later size; a range whose hashes do not fit its size is refused."""
    for start in (0, 1, 2, 3, 7, 8, 33):
        carried = CompactRange()
        for line in LINES[:start]:
            carried.append(leaf_hash(line))
        resumed = CompactRange(carried.size, carried.hashes)  # as read back from a state
        for n in range(start, len(LINES)):
            assert resumed.root() == mth(LINES[:n]), (start, n)
            resumed.append(leaf_hash(LINES[n]))
    with pytest.raises(ValueError, match="has 2 hashes"):
        CompactRange(3, [b"\0" * 32])
    with pytest.raises(ValueError, match="has 1 hashes"):
        CompactRange(1, [b"\0" * 31])

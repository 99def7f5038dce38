"""Rotation into segments without losing verifiability: the tree and the chain span every file,
across restarts and another writer, and the auditor commands read every segment."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric import ed25519

from broker.audit.log import DecisionLog
from broker.audit.records import verify_bytes
from broker.audit.segments import log_files, segment_paths
from broker.cli.audit import verify_log
from broker.crypto.checkpoint import Checkpoint, NoteSigner
from broker.crypto.merkle import MerkleTree

SEGMENT_BYTES = 600  # a few records per segment


def whole(path: Path) -> bytes:
    return b"".join(file.read_bytes() for file in log_files(path) if file.exists())


async def test_records_span_segments_and_survive_restarts(tmp_path: Path) -> None:
    path = tmp_path / "decisions.log"
    first = DecisionLog(path, segment_bytes=SEGMENT_BYTES)
    await first.open()
    for n in range(30):
        await first.append({"type": "release", "n": n})
    await first.close()
    assert len(segment_paths(path)) >= 5
    assert [p.name for p in segment_paths(path)][:2] == [
        "decisions.log.000001",
        "decisions.log.000002",
    ]

    again = DecisionLog(path, segment_bytes=SEGMENT_BYTES)  # a restart reads every segment
    await again.open()
    assert (again.head.size, again.tree.size) == (30, 30)
    appended = await again.append_entry({"type": "release", "n": 30})
    assert appended.index == 30
    lines = await asyncio.to_thread(again.read_lines, 0, 31)
    await again.close()

    data = whole(path)
    assert verify_bytes(data).head.size == 31  # one chain across the files
    assert lines == data.split(b"\n")[:-1]  # entries read across segment boundaries
    assert [json.loads(line)["n"] for line in lines] == list(range(31))
    assert MerkleTree.from_lines(lines).root() == again.tree.root()


async def test_two_writers_and_rotation_keep_one_linear_log(tmp_path: Path) -> None:
    path = tmp_path / "decisions.log"
    service = DecisionLog(path, segment_bytes=SEGMENT_BYTES)
    cli = DecisionLog(path, segment_bytes=SEGMENT_BYTES)  # as `broker keys …` would
    await service.open()
    await cli.open()
    for n in range(20):
        writer = service if n % 3 else cli
        await writer.append({"n": n})
    await service.append({"n": 20})  # catches up with the other writer's records first
    assert service.tree.size == 21
    lines = whole(path).split(b"\n")[:-1]
    assert [json.loads(line)["n"] for line in lines] == list(range(21))
    assert service.tree.root() == MerkleTree.from_lines(lines).root()
    await service.close()
    await cli.close()


async def test_audit_verify_reads_every_segment(tmp_path: Path) -> None:
    path = tmp_path / "decisions.log"
    log = DecisionLog(path, segment_bytes=SEGMENT_BYTES)
    await log.open()
    for n in range(25):
        await log.append({"n": n})
    signer = NoteSigner("seg.invalid/decisions", ed25519.Ed25519PrivateKey.generate())
    note = signer.sign(Checkpoint(signer.name, log.tree.size, log.tree.root()).body())
    await log.close()
    report = await asyncio.to_thread(verify_log, [path], note=note, key=signer.verifier_key())
    assert report["ok"], report
    assert report["records"] == 25
    segment_paths(path)[1].unlink()  # a whole segment removed
    report = await asyncio.to_thread(verify_log, [path], note=note, key=signer.verifier_key())
    assert report["ok"] is False

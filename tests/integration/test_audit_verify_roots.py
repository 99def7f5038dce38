"""``broker audit verify`` without a key (chain-only) compares the log with the checkpoint file
beside it by root, not by size (issue 27, item 9): a forger who rewrites a record and recomputes
the whole hash chain passes every chain check, but the first records no longer hash to the root
the broker published; verify exits 1 and names the record that first differs.

The log and its checkpoints are written by the broker's own writer and publisher (a checkpoint
after each record, as the broker publishes after new records).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ed25519

from broker.audit.log import DecisionLog
from broker.audit.publisher import CheckpointPublisher, checkpoint_paths
from broker.audit.records import record_hash
from broker.core.encoding import canonical
from broker.crypto.checkpoint import NoteSigner
from tests.support.cli import run

ORIGIN = "verify.test/decisions/r0"


def write_log(path: Path, records: int, *, checkpoint_every: int) -> NoteSigner:
    signer = NoteSigner(ORIGIN, ed25519.Ed25519PrivateKey.generate())

    async def write() -> None:
        log = DecisionLog(path)
        await log.open()
        publisher = CheckpointPublisher(log, signer, interval=1.0)
        for n in range(records):
            await log.append({"type": "release", "n": n})
            if (n + 1) % checkpoint_every == 0:
                await publisher.publish()
        publisher.close()
        await log.close()

    asyncio.run(write())
    return signer


def rechain(path: Path, index: int) -> None:
    """Change record ``index`` and recompute every hash after it, as a forger with the file
    (but not the signing key) would: the chain verifies on its own."""
    records = [json.loads(line) for line in path.read_bytes().splitlines()]
    records[index]["n"] = 999
    for i, record in enumerate(records):
        record["prev"] = records[i - 1]["hash"] if i else "0" * 64
        record.pop("hash", None)
        record["hash"] = record_hash(record)
    path.write_bytes(b"".join(canonical(r) + b"\n" for r in records))


def verify(*args: str) -> tuple[int, dict[str, Any]]:
    done = run("audit", "verify", *args)
    return done.returncode, json.loads(done.stdout)


def test_a_rewritten_rechained_log_fails_chain_only_verify_naming_the_record(
    tmp_path: Path,
) -> None:
    log = tmp_path / "decisions.log"
    write_log(log, 12, checkpoint_every=1)
    code, report = verify(str(log))
    assert (code, report["checkpoint_file_size"]) == (0, 12)
    rechain(log, 7)
    code, report = verify(str(log))
    assert code == 1
    assert report["first_bad_index"] == 7
    assert "record 7 was changed" in report["problem"]
    assert "do not hash to the root of its checkpoint file" in report["problem"]


def test_with_sparse_checkpoints_the_changed_record_is_bracketed(tmp_path: Path) -> None:
    """Checkpoints at 4, 8 and 12 records: a change to record 5 is somewhere in 4..7, and verify
    says exactly that (records before 4 are intact), rather than a size that matches."""
    log = tmp_path / "decisions.log"
    write_log(log, 12, checkpoint_every=4)
    rechain(log, 5)
    code, report = verify(str(log))
    assert code == 1
    assert report["first_bad_index"] == 4
    assert "one of records 4..7" in report["problem"]


def test_the_signed_path_names_the_record_too(tmp_path: Path) -> None:
    log = tmp_path / "decisions.log"
    signer = write_log(log, 10, checkpoint_every=1)
    rechain(log, 2)
    code, report = verify(str(log), "--key", signer.verifier_key())
    assert code == 1
    assert report["first_bad_index"] == 2
    assert "record 2 was changed" in report["problem"]


def test_an_intact_log_without_a_checkpoint_file_still_verifies(tmp_path: Path) -> None:
    log = tmp_path / "decisions.log"
    write_log(log, 3, checkpoint_every=1)
    for path in checkpoint_paths(log):
        path.unlink()
    code, report = verify(str(log))
    assert (code, report["ok"], report["records"]) == (0, True, 3)

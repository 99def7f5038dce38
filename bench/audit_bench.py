"""``broker audit verify`` throughput on a 1M-record log (target: >= 200k records/s).

Writes a log of N records shaped like release decisions (chained, as the broker writes them)
once under $TMPDIR, signs a checkpoint, then times the verification of the whole log against
it — the Merkle path an auditor runs — and, as the same-run baseline, plain SHA-256 over every
line (the floor: a verifier must hash each record once).

    .venv/bin/python bench/audit_bench.py [N]
"""

from __future__ import annotations

import gc
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cryptography.hazmat.primitives.asymmetric import ed25519

from broker.audit.records import GENESIS, record_hash
from broker.cli.audit import verify_log
from broker.core.encoding import canonical
from broker.crypto.checkpoint import Checkpoint, NoteSigner
from broker.crypto.merkle import MerkleTree

REASON = "image sha256:00 is not allowed for key models/llama"


def write_log(path: Path, count: int) -> None:
    previous = GENESIS
    with path.open("wb") as handle:
        for index in range(count):
            denied = index % 3 == 0
            record = {
                "type": "release", "decision_id": f"{index:08x}-0000-4000-8000-000000000000",
                "time": "2026-11-30T12:00:00+00:00", "key": "models/llama", "version": 1,
                "result": "deny" if denied else "allow",
                "code": "policy_denied" if denied else None,
                "reasons": [REASON] if denied else [],
                "policy_digest": "sha256:" + "1" * 64, "input_digest": "sha256:" + "2" * 64,
                "runner_key_thumbprint": "t" * 43, "index": index, "seq": index, "prev": previous,
            }  # fmt: skip
            record["hash"] = previous = record_hash(record)
            handle.write(canonical(record) + b"\n")


def main(count: int) -> None:
    directory = Path(tempfile.gettempdir()) / f"broker-audit-bench-{count}"
    directory.mkdir(exist_ok=True)
    log = directory / "decisions.log"
    if not log.exists():
        started = time.perf_counter()
        write_log(log, count)
        print(f"wrote {count} records in {time.perf_counter() - started:.1f} s ({log})")
    signer = NoteSigner("bench.invalid/decisions", ed25519.Ed25519PrivateKey.generate())
    data = log.read_bytes()
    lines = data.split(b"\n")[:-1]
    started = time.perf_counter()
    for line in lines:
        hashlib.sha256(line).digest()
    floor = time.perf_counter() - started
    tree = MerkleTree.from_lines(lines)
    note = signer.sign(Checkpoint(signer.name, tree.size, tree.root()).body())

    del data, lines, tree  # time the verification as the CLI runs it: in a clean heap
    gc.collect()
    started = time.perf_counter()
    report = verify_log([log], note=note, key=signer.verifier_key())  # the CLI's own code
    assert report["ok"], report
    assert report["checkpoint_size"] == count, report
    elapsed = time.perf_counter() - started
    size_mb = log.stat().st_size / 1e6
    print(f"audit verify, {count} records ({size_mb:.0f} MB), against a signed checkpoint:")
    print(
        f"  merkle verify (read, hash, tree, root) {elapsed:6.2f} s  {count / elapsed:10.0f} rec/s"
    )
    print(f"  baseline: SHA-256 of every line        {floor:6.2f} s  {count / floor:10.0f} rec/s")
    print(f"  ratio to the floor: {floor / elapsed:.2f}  (target: >= 200000 records/s)")
    print(json.dumps({"records_per_second": round(count / elapsed)}))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000)

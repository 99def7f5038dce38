"""The floor of a release on an attestation result (issue 31): the library calls one fetch cannot
avoid, served by the broker's HTTP stack (aiohttp on uvloop), and no glue.

NOT a broker and never a release path: it checks nothing that matters for security. It does not
check the EAR's issuer, audience or times, nor the proof's ``htm``/``htu``/``iat``/``ath``/nonce,
nor that the proof's key is the EAR's ``cnf`` key; it spends no ``jti``, reads no attestation
store, resolves no key version and unwraps no DEK (it holds one in memory). It exists so that
``attested_bench.py`` can print, in the same run, how fast one Python process could serve a
fetch that keeps the broker's promises, and so show how much of the gap is the broker's own work.

Per request (``POST /v1/release``, ``Authorization: DPoP <EAR>``, ``DPoP: <proof>``,
``{"keys": [name]}``), each with what the broker uses for it:

* aiohttp: read the body; the standard library's C JSON parser: parse it;
* cryptography (``crypto/jose.check_signature``, the broker's one JWS verifier): ES256 verify of
  the EAR with this broker's result key (header and claims decoded and parsed);
* the DPoP proof: its header parsed, its embedded P-256 ``jwk`` made a public key, ES256 verify,
  claims parsed, the key's RFC 7638 thumbprint and the EAR's SHA-256 (``ath``) computed;
* wasmtime: one evaluation of the shipped release policy on an input of the broker's shape
  (``release_input``: the attestation's claims, this key's ``request`` facts with
  ``request.attestation``), as canonical JSON bytes, digested with SHA-256 for the record;
* ``crypto/jwe.encrypt``: the ECDH-ES+A256KW / A256GCM JWE of a 32-byte DEK to the EAR's X25519
  encryption key, with the key id, release id and policy digest in its protected header;
* one record (the ids, digests and result; the attestation named by its ``jti``, not copied):
  canonical JSON + SHA-256 chained to the previous record, appended and fsync'd by a writer thread
  with group commit as ``broker/audit/log.py`` does it (one loop turn's appends handed over
  together; every hand-over queued while the previous ``write`` + ``fsync`` ran is one batch);
* the JSON answer, once the record is durable.

    python bench/attested_floor_server.py PORT POLICY_DIR WORKDIR KEY IMAGE_DIGEST RESULT_KEY_PEM
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import queue
import sys
import threading
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import uvloop
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey
from cryptography.hazmat.primitives.serialization import load_pem_private_key

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from floor_server import input_template

from broker.attestation.ear import CLAIM
from broker.core.encoding import b64url_decode, canonical
from broker.crypto import jwe
from broker.crypto.jose import check_signature
from broker.crypto.jwk import RunnerKey, thumbprint
from broker.policy.build import compile_policy_dir
from broker.policy.testing import find_opa
from broker.policy.wasm import WasmPolicyInstance

_Batch = list[tuple[dict[str, Any], "asyncio.Future[int]"]]


class GroupCommitLog:
    """JSON lines, chained by hash, written and fsync'd by one thread in group commits (the
    broker's log without its file lock, segments and Merkle tree)."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._queue: queue.SimpleQueue[tuple[asyncio.AbstractEventLoop, _Batch]] = (
            queue.SimpleQueue()
        )
        self._gathering: _Batch | None = None
        self._size, self._prev = 0, "0" * 64
        threading.Thread(target=self._write_batches, name="floor-log-writer", daemon=True).start()

    async def append(self, record: dict[str, Any]) -> int:
        """Append ``record``; its index, once it is on disk."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[int] = loop.create_future()
        if self._gathering is None:  # the first append of this loop turn
            self._gathering = []
            loop.call_soon(self._hand_over, loop)
        self._gathering.append((record, future))
        return await future

    def _hand_over(self, loop: asyncio.AbstractEventLoop) -> None:
        gathered, self._gathering = self._gathering or [], None
        self._queue.put((loop, gathered))

    def _write_batches(self) -> None:
        while True:
            loop, batch = self._queue.get()
            batch = list(batch)
            while True:  # everything handed over while the previous fsync ran
                try:
                    batch.extend(self._queue.get_nowait()[1])
                except queue.Empty:
                    break
            lines, indexes = [], []
            for record, _ in batch:
                sealed = canonical({**record, "index": self._size, "prev": self._prev})
                self._prev = hashlib.sha256(sealed).hexdigest()
                lines.append(sealed[:-1] + b',"hash":"' + self._prev.encode() + b'"}\n')
                indexes.append(self._size)
                self._size += 1
            os.write(self._fd, b"".join(lines))
            os.fsync(self._fd)
            loop.call_soon_threadsafe(_resolve, [f for _, f in batch], indexes)


def _resolve(futures: list[asyncio.Future[int]], indexes: list[int]) -> None:
    for future, index in zip(futures, indexes, strict=True):
        if not future.done():
            future.set_result(index)


def _parts(compact: str) -> tuple[dict[str, Any], dict[str, Any], bytes, bytes]:
    """(header, claims, signing input, signature) of a compact JWS."""
    header, claims, signature = compact.split(".")
    return (
        json.loads(b64url_decode(header)),
        json.loads(b64url_decode(claims)),
        f"{header}.{claims}".encode("ascii"),
        b64url_decode(signature),
    )


class AttestedFloor:
    def __init__(
        self, policy_dir: Path, workdir: Path, key: str, image_digest: str, result_key: Path
    ) -> None:
        self.template = input_template(key, image_digest)
        private = load_pem_private_key(result_key.read_bytes(), None)
        if not isinstance(private, ec.EllipticCurvePrivateKey):
            raise SystemExit("the result key must be an EC P-256 key")
        self.result_key = private.public_key()
        self.policy = WasmPolicyInstance(compile_policy_dir(policy_dir, opa=find_opa()))
        self.dek = os.urandom(32)
        self.log = GroupCommitLog(workdir / "attested-floor.log")

    async def release(self, request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        name = body["keys"][0]
        token = request.headers["Authorization"].partition(" ")[2]
        now = datetime.now(UTC)
        _, ear, signing_input, signature = _parts(token)
        check_signature("ES256", self.result_key, signing_input, signature)
        proof_header, proof, signing_input, signature = _parts(request.headers["DPoP"])
        jwk = proof_header["jwk"]
        point = b"\x04" + b64url_decode(jwk["x"]) + b64url_decode(jwk["y"])
        pop = ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256R1(), point)
        check_signature("ES256", pop, signing_input, signature)
        pop_thumbprint = thumbprint({m: jwk[m] for m in ("crv", "kty", "x", "y")})
        hashlib.sha256(token.encode("ascii")).digest()  # ath
        encryption_jwk = ear[CLAIM]["encryption_key"]
        encryption = RunnerKey(
            jwk=encryption_jwk,
            key=X25519PublicKey.from_public_bytes(b64url_decode(encryption_jwk["x"])),
            thumbprint=thumbprint(encryption_jwk),
        )
        facts = {
            **self.template["request"],
            "key": name,
            "runner_key_thumbprint": encryption.thumbprint,
            "attestation": {"jti": ear["jti"], "expires_at": str(ear["exp"])},
        }
        encoded = canonical({**self.template, "request": facts, "time": now.isoformat()})
        input_digest = "sha256:" + hashlib.sha256(encoded).hexdigest()
        result = self.policy.evaluate_encoded(encoded)
        if not result or result.get("allow") is not True:
            raise web.HTTPForbidden(text="the floor's policy input was not allowed")
        release_id = str(uuid.uuid4())
        header = {"kid": f"{name}#1", "decision_id": release_id, "cty": "dek"}
        header["policy_digest"] = self.policy.digest
        wrapped = jwe.encrypt(self.dek, encryption, header)
        index = await self.log.append(
            {
                "type": "attested_release",
                "decision_id": release_id,
                "timestamp": now.isoformat(),
                "attestation": {"jti": ear["jti"]},
                "dpop_jti": proof["jti"],
                "pop_key_thumbprint": pop_thumbprint,
                "runner_key_thumbprint": encryption.thumbprint,
                "result": "allow",
                "keys": [
                    {
                        "key": name,
                        "version": 1,
                        "result": "allow",
                        "reasons": list(result.get("reasons", [])),
                        "policy_digest": self.policy.digest,
                        "input_digest": input_digest,
                    }
                ],
            }
        )
        answer = {
            "release_id": release_id,
            "attestation": ear["jti"],
            "wrap": "jwe",
            "keys": [{"key": name, "version": 1, "wrapped_key": wrapped, "algorithm": "AES-256"}],
            "log_index": index,
        }
        return web.Response(body=json.dumps(answer).encode(), content_type="application/json")


async def ready(_request: web.Request) -> web.Response:
    return web.json_response({"ready": True})


def main() -> None:
    port, policy_dir, workdir, key, image_digest, result_key = sys.argv[1:7]
    floor = AttestedFloor(Path(policy_dir), Path(workdir), key, image_digest, Path(result_key))
    app = web.Application()
    app.router.add_post("/v1/release", floor.release)
    app.router.add_get("/readyz", ready)
    web.run_app(  # uvloop, as ``broker serve`` runs by default
        app,
        host="127.0.0.1",
        port=int(port),
        print=None,
        access_log=None,
        loop=uvloop.new_event_loop(),
    )


if __name__ == "__main__":
    main()

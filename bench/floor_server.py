"""The floor of a release in Python: the library calls one release cannot avoid, and no glue.

NOT a broker and never a release path: it checks nothing that matters for security (no nonce,
no claims, no binding, no key store, no durable log). It exists so that ``release_bench.py`` can
print, in the same run, how fast a Python process could possibly go, and so show how much of
the gap to the issue's target is the broker's own work and how much is the libraries' floor.

Per request, each with the library the broker uses for it:

* aiohttp: read the body; the standard library's C JSON parser: parse it;
* cryptography: RS256 verify of the token's signature (base64 decode of its three segments,
  JSON parse of the claims);
* cryptography: X25519 key generation + key agreement, one SHA-256 round (Concat KDF),
  AES-256-GCM of a 32-byte key (what an ECDH-ES JWE of one DEK costs);
* wasmtime: one evaluation of the shipped policy on an input of the broker's shape (canonical
  JSON bytes, then SHA-256 for the input digest);
* JSON + SHA-256 + write(2): one decision record appended to a file (no fsync: the broker's
  fsync is group-committed on another thread, with the GIL released);
* the JSON response.

JSON is the standard library's C codec, as in the broker (docs/decisions.md says why not
orjson).

    python bench/floor_server.py PORT JWKS POLICY_DIR WORKDIR KEY IMAGE_DIGEST
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import sys
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import uvloop
from aiohttp import web
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from broker.attestation import claims as claims_module
from broker.attestation.gca import VerifiedGcaToken
from broker.dev.issuer import DevIssuer, Workload
from broker.policy.build import compile_policy_dir
from broker.policy.testing import find_opa
from broker.policy.wasm import WasmPolicyInstance


def canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def b64(segment: str) -> bytes:
    return base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4))


def input_template(key: str, image_digest: str) -> dict[str, Any]:
    """A policy input of the broker's shape for an allowed workload, made once at start-up
    (building it is the broker's glue, not part of the floor); each request puts its own
    claims into it."""
    issuer = DevIssuer(dev_mode=True)
    now = datetime.now(UTC)
    token = issuer.mint(
        audience="floor", nonces=["n" * 43], workload=Workload(image_digest=image_digest), now=now
    )
    verified = VerifiedGcaToken(issuer.issuer, issuer.kid, json.loads(b64(token.split(".")[1])))
    return claims_module.build_input(
        request=claims_module.RequestFacts(
            key=key, version=1, purpose="model-weights", runner_key_thumbprint="t" * 43
        ),
        tee=claims_module.gca_tee(verified),
        raw_claims={"gca": verified.claims},
        gpus=[],
        now=now,
    )


def rsa_key(jwks: dict[str, Any]) -> rsa.RSAPublicKey:
    entry = jwks["keys"][0]
    numbers = rsa.RSAPublicNumbers(
        int.from_bytes(b64(entry["e"]), "big"), int.from_bytes(b64(entry["n"]), "big")
    )
    return numbers.public_key()


class Floor:
    def __init__(
        self, jwks: Path, policy_dir: Path, workdir: Path, key: str, image_digest: str
    ) -> None:
        self.template = input_template(key, image_digest)
        self.key = rsa_key(json.loads(jwks.read_bytes()))
        self.policy = WasmPolicyInstance(compile_policy_dir(policy_dir, opa=find_opa()))
        self.dek = os.urandom(32)
        self.log = os.open(workdir / "floor.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    async def release(self, request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        token = body["evidence"]["gca"]
        header, payload, signature = token.split(".")
        b64(header)
        self.key.verify(
            b64(signature), f"{header}.{payload}".encode(), padding.PKCS1v15(), hashes.SHA256()
        )
        claims = json.loads(b64(payload))
        ephemeral = X25519PrivateKey.generate()
        shared = ephemeral.exchange(X25519PublicKey.from_public_bytes(b64(body["runner_key"]["x"])))
        kek = hashlib.sha256(b"\x00\x00\x00\x01" + shared + b"A256GCM").digest()
        iv = os.urandom(12)
        sealed = AESGCM(kek).encrypt(iv, self.dek, b"protected-header")
        epk = ephemeral.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        policy_input = {**self.template, "claims": {"gca": claims}}
        encoded = canonical(policy_input)
        digest = hashlib.sha256(encoded).hexdigest()
        result = self.policy.evaluate_encoded(encoded)
        if not result or result.get("allow") is not True:
            raise web.HTTPForbidden(text="the floor's policy input was not allowed")
        decision_id = str(uuid.uuid4())
        record = canonical(
            {
                "decision_id": decision_id,
                "input_digest": digest,
                "result": result,
                "claims": claims,
            },
        )
        line = record[:-1] + b',"hash":"' + hashlib.sha256(record).hexdigest().encode() + b'"}\n'
        os.write(self.log, line)
        wrapped = b".".join(base64.urlsafe_b64encode(part) for part in (epk, iv, sealed))
        return web.Response(
            body=json.dumps({"decision_id": decision_id, "wrapped_key": wrapped.decode()}).encode(),
            content_type="application/json",
        )


def main() -> None:
    port, jwks, policy_dir, workdir, key, image_digest = sys.argv[1:7]
    floor = Floor(Path(jwks), Path(policy_dir), Path(workdir), key, image_digest)
    app = web.Application()
    app.router.add_post("/v1/release", floor.release)
    app.router.add_get("/readyz", lambda _request: web.json_response({"ready": True}))
    # uvloop, as ``broker serve`` runs by default (the echo baseline keeps asyncio's own loop,
    # as the issue measured it)
    web.run_app(
        app,
        host="127.0.0.1",
        port=int(port),
        print=None,
        access_log=None,
        loop=uvloop.new_event_loop(),
    )


if __name__ == "__main__":
    main()

"""``broker demo``, a Confidential Containers guest (issue 33): a guest as guest-components'
``kbs_protocol`` client behaves runs the KBS handshake against the demo broker with the unsigned
``sample`` evidence (the development switch is on: the demo broker listens on loopback), and the
JWE it gets for ``default/demo-llama/dek`` decrypts to the demo key's DEK (docs/kbs.md)."""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from cryptography.hazmat.primitives.asymmetric import ec

from broker.config import Settings
from broker.core.encoding import b64url_encode
from broker.crypto import jwe
from broker.kbs.wire import expected_report_data
from broker.keys.factory import open_key_service

RESOURCE = "default/demo-llama/dek"
KBS_TOML = """
[kbs]
enabled = true
allow_sample_evidence = true  # DEVELOPMENT ONLY: unsigned evidence, loopback brokers only

[kbs.resources]
"default/demo-llama/dek" = "{key}"
"""
Say = Callable[[str, str], None]


def allow_sample_guests(workdir: Path, key: str) -> None:
    """The policy's data: ``sample`` guests may have ``key`` (blocking)."""
    data_file = workdir / "policies" / "broker" / "data.json"
    data = json.loads(data_file.read_text(encoding="utf-8"))
    data["kbs_guests"] = {key: [{"technology": "sample", "measurements": {"svn": "1"}}]}
    data_file.write_text(json.dumps(data, indent=2), encoding="utf-8")


async def guest_fetches(base: str, tls: Any, settings: Settings, key: str, say: Say) -> bool:
    """auth → attest → resource, as the guest's RCAR client (its cookie jar keeps the
    session); True when the answer decrypts to ``key``'s DEK."""
    private = ec.generate_private_key(ec.SECP256R1())
    point = private.public_key().public_numbers()
    tee_pubkey = {
        "kty": "EC",
        "crv": "P-256",
        "alg": "ECDH-ES+A256KW",
        "x": b64url_encode(point.x.to_bytes(32, "big")),
        "y": b64url_encode(point.y.to_bytes(32, "big")),
    }
    jar = aiohttp.CookieJar(unsafe=True)  # 127.0.0.1: the guest's cookie store keeps it too
    async with aiohttp.ClientSession(cookie_jar=jar, base_url=base) as session:
        auth = {"version": "0.4.0", "tee": "sample", "extra-params": {}}
        async with session.post("/kbs/v0/auth", json=auth, ssl=tls) as reply:
            nonce = (await reply.json())["nonce"] if reply.status == 200 else None
        if nonce is None:
            say("kbs", f"FAILED: the handshake was refused ({reply.status})")
            return False
        signed = expected_report_data(tee_pubkey, nonce, "", "sha384")
        evidence = {"svn": "1", "report_data": base64.b64encode(signed).decode("ascii")}
        attest = {
            "init-data": None,
            "runtime-data": {"nonce": nonce, "tee-pubkey": tee_pubkey},
            "tee-evidence": {"primary_evidence": evidence, "additional_evidence": ""},
        }
        async with session.post("/kbs/v0/attest", json=attest, ssl=tls) as reply:
            attested = reply.status == 200
        async with session.get(f"/kbs/v0/resource/{RESOURCE}", ssl=tls) as reply:
            answer = await reply.json() if attested and reply.status == 200 else None
    if answer is None:
        say("kbs", f"FAILED: no resource for the guest ({reply.status})")
        return False
    compact = ".".join(answer[p] for p in ("protected", "encrypted_key", "iv", "ciphertext", "tag"))
    opened = jwe.decrypt(compact, private)
    async with open_key_service(settings.keys) as keys:
        record = await keys.resolve(key, None)
        expected = await keys.unwrap(record)
    if opened.plaintext != expected:
        say("kbs", "FAILED: the guest's answer is not the key's DEK")
        return False
    say(
        "kbs",
        f"a CoCo guest (sample evidence: DEVELOPMENT switch) ran /kbs/v0/auth, /attest, "
        f"/resource/{RESOURCE}: the JWE sealed to its tee-pubkey decrypts to {key} "
        f"v{record.version} (sha256 {hashlib.sha256(expected).hexdigest()[:12]}…)",
    )
    return True

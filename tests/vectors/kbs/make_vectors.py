"""Regenerate kbs.json: ``python tests/vectors/kbs/make_vectors.py`` (from the repo root).

Fixed keys (scalars from labels), CEK, IV and context; RSA-OAEP is randomised, so the RSA case
pins everything but ``encrypted_key`` and opens with the fixed key ``guest_rsa.pem``. Each
expectation is computed by ``tests/support/kbs_guest.py`` (the guest's algorithm, not the
broker's code) and checked equal to the broker's output before it is written.
``tests/unit/test_kbs_vectors.py`` checks them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from broker.crypto.jwe import concat_kdf
from broker.crypto.kbs_jwe import parse_tee_pubkey, seal_fixed
from broker.kbs.wire import error_body, expected_report_data
from tests.support import kbs_guest

HERE = Path(__file__).parent
RSA_PEM = HERE / "guest_rsa.pem"
CEK = hashlib.sha256(b"kbs vector cek").digest()
IV = hashlib.sha256(b"kbs vector iv").digest()[:12]
PLAINTEXT = b"a 32-byte data-encryption key!!!"
CONTEXT: dict[str, str | int] = {
    "key_version": 3,
    "policy_digest": "sha256:" + "ab" * 32,
    "release_id": "rel-0001",
}
UNSORTED: dict[str, str | int] = {
    "release_id": "rel-0001",
    "key_version": 3,
    "cty": "dek",
}  # sorted on the wire
NONCE = "bWFkZSBieSB0aGUgYnJva2VyIGZvciBvbmUgZ3Vlc3Q="  # 32 bytes, standard base64
DEVICE_EVIDENCE = '{"nvidia":{"evidence":"\\u00e9t\\u00e9","n":1}}\n\t"quoted" \\ \u00e9\u20ac'
ERRORS = [
    (
        "AttestationError",
        "Attestation error: RCAR handshake Auth failed: KBS Client Protocol "
        "Version Mismatch: expect =0.4.0 while the request is 0.3.0",
    ),
    ("PolicyDeny", "Access denied by policy"),
    ("PluginNotFound", "Plugin nope not found"),
    ("TokenVerifierError", 'Token Verifier error: "quoted" \\ caf\u00e9'),
]


def kdf(z: bytes) -> bytes:
    derived = kbs_guest.concat_kdf_sha256(z)
    assert derived == concat_kdf(z, "ECDH-ES+A256KW")
    return derived


def scalar(label: str) -> int:
    return int.from_bytes(hashlib.sha256(label.encode()).digest(), "big") % 2**250 + 1


def rsa_key() -> rsa.RSAPrivateKey:
    if not RSA_PEM.exists():
        key = rsa.generate_private_key(65537, 2048)
        pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        RSA_PEM.write_bytes(pem)
    loaded = serialization.load_pem_private_key(RSA_PEM.read_bytes(), None)
    assert isinstance(loaded, rsa.RSAPrivateKey)
    return loaded


def jwe_case(name: str, curve: ec.EllipticCurve | None, context: dict[str, str | int]) -> Any:
    case: dict[str, Any] = {"name": name, "context": context, "plaintext": PLAINTEXT.hex()}
    case |= {"cek": CEK.hex(), "iv": IV.hex()}
    ephemeral = None
    members: dict[str, Any] = dict(context)
    if curve is None:
        key: kbs_guest.GuestPrivateKey = rsa_key()
    else:
        recipient_d, ephemeral_d = scalar(f"{name} recipient"), scalar(f"{name} ephemeral")
        key = ec.derive_private_key(recipient_d, curve)
        ephemeral = ec.derive_private_key(ephemeral_d, curve)
        case |= {"recipient_d": hex(recipient_d), "ephemeral_d": hex(ephemeral_d)}
        members["epk"] = kbs_guest.epk(ephemeral)
    tee = kbs_guest.tee_pubkey(key)
    checked = parse_tee_pubkey(tee)
    answer = seal_fixed(PLAINTEXT, checked, context, cek=CEK, iv=IV, ephemeral=ephemeral)
    # the guest's header: alg, enc, then the members re-serialised from what it parsed (here a
    # textbook, insertion-ordered serialisation of them)
    textbook = json.dumps({"alg": tee["alg"], "enc": "A256GCM", **members}).encode()
    header = kbs_guest.serde_header(textbook)
    assert kbs_guest.unb64u(answer["protected"]) == header
    assert kbs_guest.open_as_guest(answer, key) == PLAINTEXT
    if curve is None:
        answer = {k: v for k, v in answer.items() if k != "encrypted_key"}
    return case | {"tee_pubkey": tee, "protected_header": header.decode(), "answer": answer}


def main() -> None:
    vectors: dict[str, Any] = {
        "jwe": [
            jwe_case("p256", ec.SECP256R1(), CONTEXT),
            jwe_case("p256-no-context", ec.SECP256R1(), {}),
            jwe_case("p256-unsorted-context", ec.SECP256R1(), UNSORTED),
            jwe_case("p521", ec.SECP521R1(), CONTEXT),
            jwe_case("rsa", None, CONTEXT),
        ]
    }
    vectors["concat_kdf"] = [
        {"z": (z := hashlib.sha512(label).digest()[:size]).hex(), "key": kdf(z).hex()}
        for label, size in ((b"z p256", 32), (b"z p521", 66))
    ]
    p256 = vectors["jwe"][0]["tee_pubkey"]
    report = []
    for tee, evidence, hash_alg in (
        (p256, "", "sha384"),
        (p256, DEVICE_EVIDENCE, "sha384"),
        (p256, DEVICE_EVIDENCE, "SHA256"),
        (p256, "", "sha512"),
        (p256, "", "sm3"),
        ({**p256, "kid": "ignored", "use": "enc"}, "", "sha384"),
        (vectors["jwe"][3]["tee_pubkey"], "", "sha384"),
        (vectors["jwe"][4]["tee_pubkey"], DEVICE_EVIDENCE, "sha384"),
    ):
        data = expected_report_data(tee, NONCE, evidence, hash_alg)
        assert data == kbs_guest.report_data(tee, NONCE, evidence, hash_alg)
        case = {"tee_pubkey": tee, "nonce": NONCE, "additional_evidence": evidence}
        report.append(case | {"hash": hash_alg, "report_data": data.hex()})
    vectors["report_data"] = report
    vectors["errors"] = [
        {"name": name, "detail": detail, "body": error_body(name, detail).decode()}
        for name, detail in ERRORS
    ]
    (HERE / "kbs.json").write_text(json.dumps(vectors, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()

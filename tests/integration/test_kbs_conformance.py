"""The facade's answers, read by the stock guest's own crates (issue 33, item 3):
``tests/kbs_conformance`` decrypts them as guest-components does (kbs-types ``Response``, the
header re-serialised for the AAD, RustCrypto's ECDH, Concat KDF, AES-KW, RSA-OAEP and
AES-GCM), computes report data with the guest's JCS library and parses error bodies as
``ErrorInformation``. It is built by ``tests/support/kbs_harness.py`` in both of serde_json's map
orders (guests are built both ways), and cargo is required, as Go is for the reference verifier.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from broker.crypto.kbs_jwe import seal_for_guest
from broker.kbs.wire import HASH_ALGORITHMS, error_body, expected_report_data, version_refusal
from tests.support import kbs_guest, kbs_harness

# A cold build of both regimes takes about a minute on 2 cores; make test builds it beforehand.
pytestmark = pytest.mark.timeout(kbs_harness.BUILD_TIMEOUT_S)
CONTEXT: dict[str, str | int] = {
    "release_id": "rel-42",
    "key_version": 7,
    "policy_digest": "sha256:" + "0f" * 32,
}
EVIDENCE = '{"nvidia":{"evidence":"\\u00e9"}}\n\t"q" \\ é€ 😀'


@pytest.fixture(scope="session")
def guest() -> dict[str, Path]:
    return kbs_harness.build()


@pytest.fixture(scope="module")
def rsa_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(65537, 2048)


def _run(binary: Path, *args: str) -> tuple[int, str]:
    done = subprocess.run(
        [str(binary), *args], capture_output=True, text=True, timeout=60, check=False
    )
    return done.returncode, (done.stdout if done.returncode == 0 else done.stderr).strip()


def _decrypt(
    binary: Path, tmp: Path, key: kbs_guest.GuestPrivateKey, answer: Any
) -> tuple[int, str]:
    (tmp / "key.json").write_text(json.dumps(kbs_guest.private_jwk(key)))
    (tmp / "answer.json").write_text(json.dumps(answer))
    return _run(binary, "decrypt", str(tmp / "key.json"), str(tmp / "answer.json"))


@pytest.mark.parametrize("curve", [ec.SECP256R1(), ec.SECP521R1()], ids=["P-256", "P-521"])
def test_guest_decrypts_our_ec_answer(
    guest: dict[str, Path], tmp_path: Path, curve: ec.EllipticCurve
) -> None:
    key = ec.generate_private_key(curve)
    plaintext = bytes(range(32))
    answer = seal_for_guest(plaintext, kbs_guest.tee_pubkey(key), context=CONTEXT)
    for binary in guest.values():
        assert _decrypt(binary, tmp_path, key, answer) == (0, plaintext.hex())
        # and the header it rebuilds is, byte for byte, the one we sent
        code, rebuilt = _run(binary, "header", str(tmp_path / "answer.json"))
        assert (code, rebuilt.encode()) == (0, kbs_guest.unb64u(answer["protected"]))


def test_guest_decrypts_our_rsa_answer(
    guest: dict[str, Path], tmp_path: Path, rsa_key: rsa.RSAPrivateKey
) -> None:
    answer = seal_for_guest(b"model key", kbs_guest.tee_pubkey(rsa_key), context=CONTEXT)
    for binary in guest.values():
        assert _decrypt(binary, tmp_path, rsa_key, answer) == (0, b"model key".hex())


def test_tampered_answer_fails_in_the_guest(guest: dict[str, Path], tmp_path: Path) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    answer = seal_for_guest(b"dek", kbs_guest.tee_pubkey(key), context=CONTEXT)
    tag = bytearray(kbs_guest.unb64u(answer["tag"]))
    tag[0] ^= 1
    code, reason = _decrypt(
        guest["sorted"], tmp_path, key, {**answer, "tag": kbs_guest.b64u(bytes(tag))}
    )
    assert code == 1
    assert "aes-256-gcm decrypt failed" in reason
    stranger = ec.generate_private_key(ec.SECP256R1())
    code, reason = _decrypt(guest["sorted"], tmp_path, stranger, answer)
    assert (code, "failed to unwrap key" in reason) == (1, True)


# (header order a textbook serialiser writes, opens in a sorted-map guest, in a preserve_order one)
ORDERS = {
    "canonical": (["alg", "enc", "epk", "key_version", "release_id"], True, True),
    "context first": (["release_id", "key_version", "epk", "alg", "enc"], False, False),
    "alg, enc, rest unsorted": (["alg", "enc", "release_id", "epk", "key_version"], False, True),
}


@pytest.mark.parametrize(("order", "in_sorted", "in_ordered"), ORDERS.values(), ids=ORDERS.keys())
def test_textbook_header_order_fails_in_the_guest(
    guest: dict[str, Path], tmp_path: Path, order: list[str], in_sorted: bool, in_ordered: bool
) -> None:
    """The trap is real: a server that authenticates the header bytes it wrote, in an order
    other than the one the guest rebuilds, is refused by the guest's own code."""
    key = ec.generate_private_key(ec.SECP256R1())
    values = {"alg": "ECDH-ES+A256KW", "enc": "A256GCM", "epk": None, **CONTEXT}
    header = {name: values[name] for name in order}
    answer = kbs_guest.textbook_seal(b"dek", kbs_guest.tee_pubkey(key), header)
    for regime, opens in (("sorted", in_sorted), ("preserve-order", in_ordered)):
        code, out = _decrypt(guest[regime], tmp_path, key, answer)
        if opens:
            assert (code, out) == (0, b"dek".hex()), regime
        else:
            assert code == 1, regime
            assert "aes-256-gcm decrypt failed" in out, regime


def test_report_data_matches_the_guests_jcs_and_hash(
    guest: dict[str, Path], tmp_path: Path, rsa_key: rsa.RSAPrivateKey
) -> None:
    keys = {
        "P-256": kbs_guest.tee_pubkey(ec.generate_private_key(ec.SECP256R1())),
        "P-521": kbs_guest.tee_pubkey(ec.generate_private_key(ec.SECP521R1())),
        "RSA": kbs_guest.tee_pubkey(rsa_key),
    }
    keys["P-256 with extra members"] = {**keys["P-256"], "kid": "k1", "use": "enc"}
    runtime = tmp_path / "runtime.json"
    for tee in keys.values():
        for evidence in ("", EVIDENCE):
            nonce = "Ea+fN/0q4S1dLlIjE4Hk0uSzJ3bKq0d3sQ4VZq1ZzLw="
            runtime.write_text(
                json.dumps({"tee-pubkey": tee, "nonce": nonce, "additional-evidence": evidence})
            )
            for hash_alg in [*HASH_ALGORITHMS, "SHA384"]:
                ours = expected_report_data(tee, nonce, evidence, hash_alg)
                assert _run(guest["sorted"], "report-data", hash_alg, str(runtime)) == (
                    0,
                    ours.hex(),
                )


@pytest.mark.parametrize(
    ("name", "detail"),
    [
        ("AttestationError", version_refusal("0.3.0") or ""),
        ("PolicyDeny", "Access denied by policy"),
        ("InvalidRequestPath", 'Request path "a/../b" is invalid \\ é'),
    ],
)
def test_error_body_parses_as_error_information(
    guest: dict[str, Path], tmp_path: Path, name: str, detail: str
) -> None:
    body = tmp_path / "error.json"
    body.write_bytes(error_body(name, detail))
    code, out = _run(guest["sorted"], "error-info", str(body))
    assert code == 0
    assert json.loads(out) == {
        "type": f"https://github.com/confidential-containers/kbs/errors/{name}",
        "detail": detail,
    }

"""The KBS facade's answer (broker/crypto/kbs_jwe.py) against the guest's reading of it
(tests/support/kbs_guest.py, written from guest-components): what it accepts and refuses as a
``tee-pubkey`` and as header context, the JWE trap a textbook serialiser falls into, and the
protocol's wire constants (broker/kbs/wire.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.keywrap import InvalidUnwrap

from broker.core.errors import ErrorCode, InputError
from broker.crypto.kbs_jwe import parse_tee_pubkey, seal_for_guest
from broker.kbs import wire
from broker.kbs.wire import canonical_tee, version_refusal
from tests.support import kbs_guest

P256 = ec.generate_private_key(ec.SECP256R1())
P521 = ec.generate_private_key(ec.SECP521R1())
CONTEXT: dict[str, str | int] = {"release_id": "r-7", "key_version": 2}


@pytest.fixture(scope="module")
def rsa_guest() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(65537, 2048)


@pytest.mark.parametrize("curve_key", [P256, P521], ids=["P-256", "P-521"])
def test_ec_answer_opens_as_the_guest_opens_it(curve_key: ec.EllipticCurvePrivateKey) -> None:
    answer = seal_for_guest(b"dek", kbs_guest.tee_pubkey(curve_key), context=CONTEXT)
    assert set(answer) == {"protected", "encrypted_key", "iv", "ciphertext", "tag"}
    for preserve_order in (False, True):
        opened = kbs_guest.open_as_guest(answer, curve_key, preserve_order=preserve_order)
        assert opened == b"dek"


def test_rsa_answer_opens_as_the_guest_opens_it(rsa_guest: rsa.RSAPrivateKey) -> None:
    answer = seal_for_guest(b"dek", kbs_guest.tee_pubkey(rsa_guest), context=CONTEXT)
    header = json.loads(kbs_guest.unb64u(answer["protected"]))
    assert header == {"alg": "RSA-OAEP-256", "enc": "A256GCM", **CONTEXT}
    assert kbs_guest.open_as_guest(answer, rsa_guest) == b"dek"


def test_answer_for_another_key_does_not_open() -> None:
    answer = seal_for_guest(b"dek", kbs_guest.tee_pubkey(P256), context={})
    other = ec.generate_private_key(ec.SECP256R1())
    with pytest.raises(InvalidUnwrap):
        kbs_guest.open_as_guest(answer, other)


# Header orders a textbook server might write (``epk`` where it stands), and whether a guest
# with sorted maps, then one with serde_json's preserve_order, decrypts the answer.
ORDERS = {
    "canonical": (["alg", "enc", "epk", "key_version", "release_id"], True, True),
    "context first (crypto/jwe.py)": (
        ["release_id", "key_version", "epk", "alg", "enc"],
        False,
        False,
    ),
    "enc before alg": (["enc", "alg", "epk", "key_version", "release_id"], False, False),
    "alg, enc, rest unsorted": (["alg", "enc", "release_id", "epk", "key_version"], False, True),
}


@pytest.mark.parametrize(
    ("order", "sorted_guest", "ordered_guest"), ORDERS.values(), ids=ORDERS.keys()
)
def test_textbook_header_order_fails_the_guest(
    order: list[str], sorted_guest: bool, ordered_guest: bool
) -> None:
    """The trap (issue 33): the guest authenticates the header it rebuilds, not the one sent."""
    values = {"alg": "ECDH-ES+A256KW", "enc": "A256GCM", "epk": None, **CONTEXT}
    answer = kbs_guest.textbook_seal(
        b"dek", kbs_guest.tee_pubkey(P256), {name: values[name] for name in order}
    )
    for preserve_order, opens in ((False, sorted_guest), (True, ordered_guest)):
        if opens:
            assert kbs_guest.open_as_guest(answer, P256, preserve_order=preserve_order) == b"dek"
        else:
            with pytest.raises(InvalidTag):
                kbs_guest.open_as_guest(answer, P256, preserve_order=preserve_order)


def _tee(**changes: Any) -> dict[str, Any]:
    jwk: dict[str, Any] = kbs_guest.tee_pubkey(P256)
    jwk.update(changes)
    return {k: v for k, v in jwk.items() if v is not None}


UNSUPPORTED = {
    "kty OKP": _tee(kty="OKP", crv="X25519"),
    "crv P-384": _tee(crv="P-384"),
    "alg ECDH-ES": _tee(alg="ECDH-ES"),
    "alg missing": _tee(alg=None),
    "RSA1_5": {"kty": "RSA", "alg": "RSA1_5", "n": "AQAB", "e": "AQAB"},
    "AKP": {"kty": "AKP", "alg": "ML-KEM-768+A192KW", "pub": "AAAA"},
}


@pytest.mark.parametrize("jwk", UNSUPPORTED.values(), ids=UNSUPPORTED.keys())
def test_tee_pubkey_unsupported(jwk: dict[str, Any]) -> None:
    with pytest.raises(InputError) as refused:
        parse_tee_pubkey(jwk)
    assert refused.value.code is ErrorCode.TEE_PUBKEY_UNSUPPORTED


def _small_rsa() -> dict[str, str]:
    return kbs_guest.tee_pubkey(rsa.generate_private_key(65537, 1024))


def _point_off_curve() -> dict[str, Any]:
    y = bytearray(kbs_guest.unb64u(_tee()["y"]))
    y[-1] ^= 1
    return _tee(y=kbs_guest.b64u(bytes(y)))


INVALID = {
    "not an object": "EC",
    "private member d": _tee(d="AAAA"),
    "x missing": _tee(x=None),
    "x not base64url": _tee(x="a+b/"),
    "x too long": _tee(x="A" * 2000),
    "x 31 bytes": _tee(x=kbs_guest.b64u(bytes(31))),
    "point not on the curve": _point_off_curve(),
    "RSA 1024": _small_rsa(),
    "RSA exponent 1": {
        **kbs_guest.tee_pubkey(P256),
        "kty": "RSA",
        "alg": "RSA-OAEP-256",
        "n": kbs_guest.b64u(b"\xc5" * 256),
        "e": "AQ",
    },
}


@pytest.mark.parametrize("jwk", INVALID.values(), ids=INVALID.keys())
def test_tee_pubkey_invalid(jwk: Any) -> None:
    with pytest.raises(InputError) as refused:
        parse_tee_pubkey(jwk)
    assert refused.value.code is ErrorCode.TEE_PUBKEY_INVALID
    assert refused.value.status == 400


def test_tee_pubkey_keeps_only_the_typed_members() -> None:
    members = parse_tee_pubkey(_tee(kid="k", use="enc")).members
    assert set(members) == {"kty", "crv", "alg", "x", "y"}


BAD_CONTEXT = {
    "float": {"version": 1.0},
    "bool": {"allowed": True},
    "non-ASCII": {"release_id": "r\u00e9"},
    "control character": {"release_id": "r\n1"},
    "nested object": {"release": {"id": "r"}},
    "JOSE name epk": {"epk": "x"},
    "JOSE name crit": {"crit": "x"},
    "name with space": {"release id": "r"},
    "integer past 64 bits": {"n": 2**63},
    "too many members": {f"m{i}": i for i in range(17)},
}


@pytest.mark.parametrize("context", BAD_CONTEXT.values(), ids=BAD_CONTEXT.keys())
def test_context_outside_ascii_strings_and_integers_refused(context: dict[str, Any]) -> None:
    with pytest.raises(InputError) as refused:
        seal_for_guest(b"dek", kbs_guest.tee_pubkey(P256), context=context)
    assert refused.value.code is ErrorCode.KBS_HEADER_MEMBER_INVALID


def test_context_at_the_limits_accepted() -> None:
    context: dict[str, str | int] = {"low": -(2**63), "high": 2**63 - 1, "cty": 'a"\\b'}
    context["text"] = "~" * 512
    answer = seal_for_guest(b"dek", kbs_guest.tee_pubkey(P256), context=context)
    assert kbs_guest.open_as_guest(answer, P256) == b"dek"


@pytest.mark.parametrize(
    ("requested", "refusal"),
    [
        ("0.4.0", None),
        ("0.4.0+build.7", None),
        ("0.3.0", "Version Mismatch: expect =0.4.0 while the request is 0.3.0"),
        ("0.4.0-rc1", "Version Mismatch: expect =0.4.0 while the request is 0.4.0-rc1"),
        ("0.4.1", "Version Mismatch: expect =0.4.0 while the request is 0.4.1"),
        ("0.4", "failed to parse KBS version"),
        ("00.4.0", "failed to parse KBS version"),
        ("", "failed to parse KBS version"),
    ],
)
def test_version_refusal_as_trustee(requested: str, refusal: str | None) -> None:
    answer = version_refusal(requested)
    if refusal is None:
        assert answer is None
    else:
        assert answer is not None
        assert answer.startswith("Attestation error: RCAR handshake Auth failed: ")
        assert answer.endswith(refusal)
        assert ("KBS Client Protocol Version Mismatch" in answer) == ("Mismatch" in refusal)


@pytest.mark.parametrize(
    ("name", "tee"),
    [("tdx", "tdx"), ("snp", "snp"), ("nvidiadpu", "nvidia-dpu"), ("sev", None), ("TDX", None)],
)
def test_tee_names_as_kbs_types_reads_them(name: str, tee: str | None) -> None:
    assert canonical_tee(name) == tee


def test_protocol_constants_hang_together() -> None:
    """What the facade builds on (values from the guest's code; wire.py names the files)."""
    assert version_refusal(wire.PROTOCOL_VERSION) is None
    assert (wire.KBS_PREFIX, wire.SESSION_COOKIE) == ("/kbs/v0", "kbs-session-id")
    keys = (wire.SUPPORTED_HASH_ALGORITHMS, wire.SELECTED_HASH_ALGORITHM)
    assert keys == ("supported-hash-algorithms", "selected-hash-algorithm")
    assert wire.DEFAULT_HASH_ALGORITHM in wire.HASH_ALGORITHMS
    assert wire.SAMPLE_TEES < wire.TEE_NAMES
    assert "sev" not in wire.TEE_NAMES
    assert wire.NONCE_BYTES == 32

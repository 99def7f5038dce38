"""The X.509-SVID rules ``broker/crypto/svid.py`` enforces (issue 32), offline: SPIFFE ID paths
and trust domain names (SPIFFE ID §2), the CSRs a runner may send, and the bundle's JWKs for
each kind of authority key (read back with PyJWT, another JOSE implementation)."""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from jwt.algorithms import ECAlgorithm, RSAAlgorithm

from broker.core.errors import ErrorCode
from broker.crypto.jwk import public_jwk, thumbprint
from broker.crypto.svid import (
    CsrRefused,
    authority_jwk,
    bundle_jwks,
    csr_key,
    load_csr,
    pem,
    spiffe_id,
    valid_trust_domain,
)
from tests.support.identity_cas import ca_certificate, make_issuing_ca, root_key

NOW = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
TD = "runners.example"


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("shards/llama", "spiffe://runners.example/shards/llama"),
        ("/a.b/c_d-e/", "spiffe://runners.example/a.b/c_d-e"),  # outer slashes dropped
        ("A9", "spiffe://runners.example/A9"),
    ],
)
def test_a_spiffe_id_path_of_allowed_segments_is_accepted(path: str, expected: str) -> None:
    assert spiffe_id(TD, path) == expected


@pytest.mark.parametrize(
    "path",
    [
        "",
        "/",
        "*",
        "shards/*",  # a wildcard (X509-SVID §2: no wildcards)
        "a//b",  # an empty segment
        "a/./b",
        "a/../b",
        "..",
        "web\n",  # a trailing newline: `$` would have let it through
        "a\n/b",
        "a/b\n",
        "a%2Fb",  # percent-encoding
        "wörk",  # non-ASCII
        "a b",
        "a?b",
        "a#b",
        "a\\b",
        "a" * 2049,
    ],
)
def test_a_spiffe_id_path_outside_the_rules_is_refused(path: str) -> None:
    with pytest.raises(ValueError, match="SPIFFE ID path"):
        spiffe_id(TD, path)


@pytest.mark.parametrize(
    "name", ["runners.example", "td", "a-b_c.d", "x" * 255, "127.0.0.1", "a.b.c"]
)
def test_a_trust_domain_name_of_the_rules_is_valid(name: str) -> None:
    assert valid_trust_domain(name)
    assert spiffe_id(name, "w") == f"spiffe://{name}/w"


@pytest.mark.parametrize(
    "name",
    [
        "",
        "Runners.example",  # upper case
        ".runners",
        "runners.",
        "runners.example\n",
        "run ners",
        "rünners",
        "runners:8443",
        "user@runners",
        "runners/x",
        "x" * 256,
    ],
)
def test_a_trust_domain_name_outside_the_rules_is_refused(name: str) -> None:
    assert not valid_trust_domain(name)
    with pytest.raises(ValueError, match="trust domain"):
        spiffe_id(name, "w")


def _csr(key: ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey) -> bytes:
    algorithm = None if isinstance(key, ed25519.Ed25519PrivateKey) else hashes.SHA256()
    built = x509.CertificateSigningRequestBuilder().subject_name(x509.Name([])).sign(key, algorithm)
    return built.public_bytes(serialization.Encoding.DER)


def _patched(der: bytes, find: str, offset: int, value: int) -> str:
    """``der`` with one byte of the first ``find`` (hex) changed, as base64."""
    changed = bytearray(der)
    changed[changed.find(bytes.fromhex(find)) + offset] = value
    return base64.b64encode(bytes(changed)).decode()


P256_CSR = _csr(ec.generate_private_key(ec.SECP256R1()))


@pytest.mark.parametrize(
    "text",
    [
        # id-ecPublicKey 1.2.840.10045.2.1 made 1.2.840.10045.2.5: UnsupportedAlgorithm, not 500
        _patched(P256_CSR, "06072a8648ce3d0201", 8, 0x05),
        # prime256v1 1.2.840.10045.3.1.7 made 1.2.840.10045.3.1.6, a curve no one supports
        _patched(P256_CSR, "06082a8648ce3d030107", 9, 0x06),
    ],
    ids=["unknown-key-algorithm", "unknown-curve"],
)
def test_unsupported_key_algorithm_in_csr_is_csr_key_invalid(text: str) -> None:
    with pytest.raises(CsrRefused) as caught:
        csr_key(load_csr(text), "no-pop-key")
    assert caught.value.code is ErrorCode.CSR_KEY_INVALID
    assert caught.value.status == 400


@pytest.mark.parametrize(
    "key",
    [ec.generate_private_key(ec.SECP384R1()), ed25519.Ed25519PrivateKey.generate()],
    ids=["P-384", "Ed25519"],
)
def test_a_csr_for_another_kind_of_key_is_csr_key_invalid(
    key: ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey,
) -> None:
    text = base64.b64encode(_csr(key)).decode()
    with pytest.raises(CsrRefused) as caught:
        csr_key(load_csr(text), "no-pop-key")
    assert caught.value.code is ErrorCode.CSR_KEY_INVALID


def test_an_unknown_signature_algorithm_is_csr_signature_invalid() -> None:
    # ecdsa-with-SHA256 1.2.840.10045.4.3.2 made 1.2.840.10045.4.3.9 (no such algorithm)
    text = _patched(P256_CSR, "06082a8648ce3d040302", 9, 0x09)
    with pytest.raises(CsrRefused) as caught:
        load_csr(text)
    assert caught.value.code is ErrorCode.CSR_SIGNATURE_INVALID


def test_the_pop_key_is_refused_and_another_p256_key_accepted() -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    csr = load_csr(base64.b64encode(_csr(key)).decode())
    pop = thumbprint(public_jwk(key.public_key()))
    with pytest.raises(CsrRefused) as caught:
        csr_key(csr, pop)
    assert caught.value.code is ErrorCode.CSR_KEY_IS_POP_KEY
    assert csr_key(csr, "another").public_numbers() == key.public_key().public_numbers()


@pytest.mark.parametrize("kind", ["P-256", "P-384", "P-521", "RSA-3072"])
def test_each_authority_key_kind_is_a_correct_jwk(kind: str) -> None:
    """PyJWT reads each JWK back into the very key of the certificate (P-384 was
    ``crv: "secp384r1"``, an RSA root no key at all)."""
    root = make_issuing_ca(NOW, root=kind).root
    jwk = authority_jwk(root)
    reader = RSAAlgorithm if kind.startswith("RSA") else ECAlgorithm
    read = reader.from_jwk(json.dumps(jwk))
    expected = root.public_key()
    assert read.public_numbers() == expected.public_numbers()  # type: ignore[union-attr]
    if kind != "RSA-3072":
        assert jwk["crv"] == kind
        size = {"P-256": 32, "P-384": 48, "P-521": 66}[kind]  # RFC 7518 §6.2.1.2: full length
        assert len(base64.urlsafe_b64decode(jwk["x"] + "==")) == size


@pytest.mark.parametrize("kind", ["Ed25519", "RSA-1024", "secp256k1"])
def test_an_authority_key_the_bundle_cannot_carry_is_refused(kind: str) -> None:
    signer = ec.generate_private_key(ec.SECP256K1()) if kind == "secp256k1" else root_key(kind)
    root = ca_certificate("odd", signer, signer, valid=(NOW, NOW), path_length=1)
    with pytest.raises(ValueError, match="must be EC P-256, P-384, P-521 or RSA"):
        authority_jwk(root)


def test_the_jwks_and_pem_forms_list_the_same_authorities_in_order() -> None:
    roots = [make_issuing_ca(NOW, root=kind).root for kind in ("P-384", "RSA-3072", "P-256")]
    jwks = bundle_jwks(roots, sequence=7, refresh=300)
    keys = jwks["keys"]
    assert isinstance(keys, list)
    from_jwks = [base64.b64decode(k["x5c"][0]) for k in keys]
    from_pem = [
        c.public_bytes(serialization.Encoding.DER)
        for c in x509.load_pem_x509_certificates(pem(roots).encode())
    ]
    assert from_jwks == from_pem == [r.public_bytes(serialization.Encoding.DER) for r in roots]
    assert [k["use"] for k in keys] == ["x509-svid"] * 3
    assert (jwks["spiffe_sequence"], jwks["spiffe_refresh_hint"]) == (7, 300)

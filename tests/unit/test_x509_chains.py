"""Each path-validation rule, with crafted chains, against both validators: ``cryptography``'s
verifier (``verify_chain``) and the legacy-encoding walk kept for NVIDIA RIM signer chains."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from broker.core.errors import AttestationError
from broker.crypto.x509chain import verify_chain, verify_chain_legacy_encoding
from tests.vectors.gpu import key_usage

NOW = datetime(2026, 6, 1, tzinfo=UTC)
VALIDATORS = {"library": verify_chain, "legacy": verify_chain_legacy_encoding}
UNKNOWN_OID = x509.ObjectIdentifier("1.3.6.1.4.1.99999.1")


@dataclass
class Spec:
    """One certificate of a crafted chain (root first)."""

    name: str
    ca: bool = True
    path_length: int | None = None
    cert_sign: bool | None = None  # None: the natural value (CA: True, leaf: False)
    unknown_critical: bool = False
    valid_days: tuple[int, int] = (-10, 300)
    extra: list[x509.ExtensionType] = field(default_factory=list)


def build(specs: list[Spec]) -> list[x509.Certificate]:
    """Certificates leaf first; ``specs`` root first."""
    keys = [ec.generate_private_key(ec.SECP256R1()) for _ in specs]
    certs: list[x509.Certificate] = []
    for index, (spec, key) in enumerate(zip(specs, keys, strict=True)):
        issuer_key = keys[index - 1] if index else key
        issuer_name = certs[-1].subject if index else None
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, spec.name)])
        cert_sign = spec.ca if spec.cert_sign is None else spec.cert_sign
        builder = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(issuer_name or name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(NOW + timedelta(days=spec.valid_days[0]))
            .not_valid_after(NOW + timedelta(days=spec.valid_days[1]))
            .add_extension(
                x509.BasicConstraints(ca=spec.ca, path_length=spec.path_length), critical=True
            )
            .add_extension(key_usage(sign=not cert_sign, cert_sign=cert_sign), critical=True)
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()),
                critical=False,
            )
        )
        if spec.unknown_critical:
            builder = builder.add_extension(
                x509.UnrecognizedExtension(UNKNOWN_OID, b"\x05\x00"), critical=True
            )
        certs.append(builder.sign(issuer_key, hashes.SHA256()))
    return certs[::-1]


Validator = Callable[..., list[x509.Certificate]]


def check(validator: Validator, chain: list[x509.Certificate]) -> list[x509.Certificate]:
    return validator(chain[0], chain[1:-1], [chain[-1]], now=NOW)


@pytest.fixture(params=sorted(VALIDATORS))
def validator(request: pytest.FixtureRequest) -> Validator:
    return VALIDATORS[request.param]


def test_control_chain_validates(validator: Validator) -> None:
    chain = build([Spec("root", path_length=1), Spec("ica", path_length=0), Spec("leaf", ca=False)])
    assert len(check(validator, chain)) == 3


def test_pathlen_zero_root_signing_an_intermediate_ca_rejected(validator: Validator) -> None:
    chain = build([Spec("root", path_length=0), Spec("ica"), Spec("leaf", ca=False)])
    with pytest.raises(AttestationError) as caught:
        check(validator, chain)
    assert caught.value.code.value == "cert_chain_invalid"


def test_pathlen_one_allows_exactly_one_intermediate(validator: Validator) -> None:
    ok = build([Spec("root", path_length=1), Spec("ica"), Spec("leaf", ca=False)])
    assert check(validator, ok)
    too_deep = build(
        [Spec("root", path_length=1), Spec("ica1"), Spec("ica2"), Spec("leaf", ca=False)]
    )
    with pytest.raises(AttestationError):
        check(validator, too_deep)


@pytest.mark.parametrize("where", ["leaf", "ica"])
def test_unknown_critical_extension_rejected(validator: Validator, where: str) -> None:
    specs = [Spec("root"), Spec("ica", unknown_critical=where == "ica")]
    specs.append(Spec("leaf", ca=False, unknown_critical=where == "leaf"))
    with pytest.raises(AttestationError):
        check(validator, build(specs))


def test_issuer_without_key_cert_sign_rejected(validator: Validator) -> None:
    chain = build([Spec("root"), Spec("ica", cert_sign=False), Spec("leaf", ca=False)])
    with pytest.raises(AttestationError):
        check(validator, chain)


def test_leaf_acting_as_ca_rejected(validator: Validator) -> None:
    chain = build(
        [Spec("root"), Spec("not-a-ca", ca=False, cert_sign=True), Spec("leaf", ca=False)]
    )
    with pytest.raises(AttestationError):
        check(validator, chain)


@pytest.mark.parametrize("window", [(-300, -1), (1, 300)])
def test_intermediate_outside_its_validity_rejected(
    validator: Validator, window: tuple[int, int]
) -> None:
    chain = build([Spec("root"), Spec("ica", valid_days=window), Spec("leaf", ca=False)])
    with pytest.raises(AttestationError):
        check(validator, chain)


def test_chain_to_another_root_rejected(validator: Validator) -> None:
    chain = build([Spec("root"), Spec("ica"), Spec("leaf", ca=False)])
    other_root = build([Spec("root")])[0]  # same name, other key
    with pytest.raises(AttestationError):
        validator(chain[0], chain[1:-1], [other_root], now=NOW)


def test_no_anchor_means_no_chain(validator: Validator) -> None:
    chain = build([Spec("root"), Spec("leaf", ca=False)])
    with pytest.raises(AttestationError):
        validator(chain[0], [], [], now=NOW)

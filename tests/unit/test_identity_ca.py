"""The workload-certificate CA (``signers/identity_ca.py``, issue 32), offline and at fixed
times: a chain not valid at start-up stops it; one that expires while the broker runs issues
nothing (``identity_ca_unavailable``) and is warned about beforehand; the bundle carries only
authorities its JWKS can express, and a retired one until it expires; what the CA key signed is
verified before anyone gets it."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from broker.core.errors import ConfigError, ErrorCode, UpstreamError
from broker.crypto.svid import LeafProfile, leaf_tbs, new_serial
from broker.signers.identity_ca import IdentityCa, load_ca
from broker.signers.results import LocalResultSigner
from tests.support.identity_cas import IssuingCa, ca_certificate, make_issuing_ca, root_key

NOW = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
TD = "runners.example"
HOUR = timedelta(hours=1)


def _load(
    tmp_path: Path, ca: IssuingCa, *, now: datetime = NOW, previous: tuple[Path, ...] = ()
) -> IdentityCa:
    ca.write(tmp_path / "identity")
    return load_ca(
        trust_domain=TD,
        signer=LocalResultSigner(ca.key),
        chain_file=tmp_path / "identity" / "ca-chain.pem",
        previous_files=list(previous),
        max_lifetime=HOUR,
        now=now,
    )


@pytest.mark.parametrize(
    ("window", "said"),
    [
        ((timedelta(days=-400), timedelta(days=-1)), "expired at"),
        ((timedelta(days=2), timedelta(days=400)), "is not valid before"),
        ((timedelta(days=-400), timedelta(0)), "expired at"),  # notAfter == now: expired
    ],
    ids=["expired", "not-yet-valid", "expires-now"],
)
def test_a_ca_chain_not_valid_now_stops_start_up(
    tmp_path: Path, window: tuple[timedelta, timedelta], said: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        _load(tmp_path, make_issuing_ca(NOW, intermediate=window))
    assert caught.value.key == "identity.ca_certificates"
    assert said in caught.value.message


def test_an_expired_root_stops_start_up(tmp_path: Path) -> None:
    ca = make_issuing_ca(
        NOW - timedelta(days=30),
        root_until=timedelta(days=10),
        intermediate=(timedelta(0), timedelta(days=60)),  # valid now: only the root is not
    )
    with pytest.raises(ConfigError) as caught:
        _load(tmp_path, ca)
    assert "'CN=test root' expired at" in caught.value.message


def test_a_ca_expiring_within_max_lifetime_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ca = _load(tmp_path, make_issuing_ca(NOW, intermediate=(-HOUR, timedelta(minutes=30))))
    assert any(
        r.levelno == logging.WARNING and "within max_lifetime_seconds" in r.getMessage()
        for r in caplog.records
    )
    assert ca.valid_until == NOW + timedelta(minutes=30)
    assert ca.valid_from == NOW - timedelta(minutes=5)  # the root's start is the later one
    assert ca.expiry_warning(NOW - 2 * HOUR) is not None  # before valid_from
    assert ca.expiry_warning(NOW + timedelta(minutes=30)) == (
        f"the identity CA expired at {ca.valid_until.isoformat()}: no workload certificate "
        "is issued"
    )
    healthy = _load(tmp_path, make_issuing_ca(NOW))
    assert healthy.expiry_warning(NOW) is None


def test_an_expired_ca_issues_nothing(tmp_path: Path) -> None:
    ca = _load(tmp_path, make_issuing_ca(NOW, intermediate=(-HOUR, HOUR)))
    ca.check_valid(NOW)
    ca.check_valid(NOW + HOUR - timedelta(microseconds=1))
    for when in (NOW + HOUR, NOW + 2 * HOUR, NOW - HOUR):  # at its notAfter, after, before
        with pytest.raises(UpstreamError) as caught:
            ca.check_valid(when)
        assert caught.value.code is ErrorCode.IDENTITY_CA_UNAVAILABLE
        assert caught.value.status == 503


@pytest.mark.parametrize(
    ("kind", "setting"),
    [("Ed25519", "identity.ca_certificates"), ("Ed25519", "identity.previous_ca_certificates")],
)
def test_an_authority_the_jwks_bundle_cannot_carry_stops_start_up(
    tmp_path: Path, kind: str, setting: str
) -> None:
    previous: tuple[Path, ...] = ()
    if setting == "identity.ca_certificates":
        ca = make_issuing_ca(NOW, root=kind)
    else:
        ca = make_issuing_ca(NOW)
        signer = root_key(kind)
        retired = ca_certificate("retired", signer, signer, valid=(NOW, NOW + HOUR), path_length=1)
        path = tmp_path / "previous.pem"
        path.write_bytes(retired.public_bytes(serialization.Encoding.PEM))
        previous = (path,)
    with pytest.raises(ConfigError) as caught:
        _load(tmp_path, ca, previous=previous)
    assert caught.value.key == setting
    assert "must be EC P-256, P-384, P-521 or RSA" in caught.value.message


@pytest.mark.parametrize("kind", ["P-384", "P-521", "RSA-3072"])
def test_roots_of_other_key_kinds_load_and_are_in_the_bundle(tmp_path: Path, kind: str) -> None:
    ca = make_issuing_ca(NOW, root=kind)
    loaded = _load(tmp_path, ca)
    keys = loaded.bundle(NOW)["keys"]
    assert isinstance(keys, list)
    (jwk,) = keys
    assert jwk["kty"] == ("RSA" if kind.startswith("RSA") else "EC")


def test_a_previous_authority_is_in_the_bundle_until_it_expires(tmp_path: Path) -> None:
    old = make_issuing_ca(NOW - timedelta(days=300), name="old", root_until=timedelta(days=301))
    path = tmp_path / "old-root.pem"
    path.write_bytes(old.root.public_bytes(serialization.Encoding.PEM))
    ca = _load(tmp_path, make_issuing_ca(NOW), previous=(path,))
    before = NOW + timedelta(hours=23)
    after = old.root.not_valid_after_utc
    assert ca.authorities(before) == [ca.chain[-1], old.root]
    assert ca.authorities(after) == [ca.chain[-1]]
    for when, count in ((before, 2), (after, 1)):
        keys = ca.bundle(when)["keys"]
        assert isinstance(keys, list)
        assert (
            len(keys) == count == len(x509.load_pem_x509_certificates(ca.bundle_pem(when).encode()))
        )


async def test_a_leaf_the_ca_key_did_not_sign_is_never_issued(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The key service answered a signature by another key (a wrong key version): the leaf
    would verify nowhere, so it is refused (``identity_ca_unavailable``) and logged."""
    loaded = _load(tmp_path, make_issuing_ca(NOW))
    key = ec.generate_private_key(ec.SECP256R1())
    profile = LeafProfile("spiffe://runners.example/w", NOW, NOW + HOUR, new_serial(), "j", "d")
    tbs = leaf_tbs(profile, key.public_key(), loaded.issuer)
    leaf = await loaded.sign(tbs)  # the right key: verified and answered
    leaf.verify_directly_issued_by(loaded.issuer)
    wrong = IdentityCa(
        TD,
        LocalResultSigner(ec.generate_private_key(ec.SECP256R1())),
        loaded.chain,
        (),
        HOUR,
    )
    with pytest.raises(UpstreamError) as caught:
        await wrong.sign(tbs)
    assert caught.value.code is ErrorCode.IDENTITY_CA_UNAVAILABLE
    assert any("does not verify" in r.getMessage() for r in caplog.records)

"""A KBS guest's token (``attestation/kbs_token.py``) is this broker's EAR with the
``tee-pubkey`` where Trustee reads it and no ``cnf``; only such tokens pass
``verify_kbs_token``, and none of them passes ``verify_ear`` (a DPoP result and a bearer token
never stand for each other)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

from broker.attestation.ear import Submod, ear_claims, sign_ear, verify_ear
from broker.attestation.kbs_token import kbs_token_claims, verify_kbs_token
from broker.attestation.stored import AttestationEntry
from broker.core.errors import AttestationError, ErrorCode, UpstreamError
from broker.crypto.jwk import public_jwk, thumbprint
from broker.decisions.kbs_cache import TokenCache
from tests.support.kbs_client import tee_key

NOW = datetime(2026, 12, 7, 12, tzinfo=UTC)
ISSUER = "https://broker.example"
PRIVATE = ec.generate_private_key(ec.SECP256R1())
KID = thumbprint(public_jwk(PRIVATE.public_key()))
KEYS = {KID: PRIVATE.public_key()}
SUBMODS = [Submod("cpu0", "affirming", {"hardware": 2}, ["sha256:p"])]


def _claims(**change: Any) -> dict[str, Any]:
    _, jwk = tee_key()
    claims = kbs_token_claims(
        issuer=ISSUER,
        jti="jti-1",
        now=NOW,
        ttl=timedelta(seconds=300),
        not_after=None,
        nonce="n",
        verifier_build="b",
        submods=SUBMODS,
        tee_pubkey=jwk,
        tee="tdx",
        protocol="0.4.0",
        policy_digest="sha256:p",
        evidence_digests={},
        input_digest="sha256:i",
    )
    return claims | change


def _sign(claims: dict[str, Any]) -> str:
    def raw(data: bytes) -> bytes:
        r, s = decode_dss_signature(PRIVATE.sign(data, ec.ECDSA(hashes.SHA256())))
        return r.to_bytes(32, "big") + s.to_bytes(32, "big")

    return sign_ear(claims, kid=KID, sign=raw)


def test_the_token_names_the_tee_pubkey_where_trustee_reads_it() -> None:
    claims = _claims()
    key = claims["submods"]["cpu0"]["ear.veraison.annotated-evidence"]["runtime_data_claims"]
    assert key["tee-pubkey"]["alg"] == "ECDH-ES+A256KW"
    assert (claims["nbf"], claims["exp"]) == (int(NOW.timestamp()), int(NOW.timestamp()) + 300)
    assert "cnf" not in claims
    presented = verify_kbs_token(_sign(claims), keys=KEYS, audience=ISSUER, now=NOW)
    assert (presented.jti, presented.tee, presented.tee_pubkey) == (
        "jti-1",
        "tdx",
        key["tee-pubkey"],
    )


def test_kbs_token_is_no_dpop_result() -> None:
    with pytest.raises(AttestationError):
        verify_ear(_sign(_claims()), keys=KEYS, audience=ISSUER, now=NOW)


def test_dpop_result_is_no_kbs_token() -> None:
    pop = public_jwk(ec.generate_private_key(ec.SECP256R1()).public_key())
    dpop = ear_claims(
        issuer=ISSUER, audience=ISSUER, jti="j", now=NOW, ttl=timedelta(seconds=60),
        not_after=None, nonce="n", verifier_build="b", submods=SUBMODS, pop_jwk=pop,
        encryption_jwk=pop, policy_digest="sha256:p", evidence_digests={},
    )  # fmt: skip
    with pytest.raises(AttestationError) as caught:
        verify_kbs_token(_sign(dpop), keys=KEYS, audience=ISSUER, now=NOW)
    assert caught.value.code is ErrorCode.KBS_TOKEN_INVALID


def test_two_different_tee_pubkeys_in_one_token_rejected() -> None:
    claims = _claims()
    _, other = tee_key()
    claims["submods"]["cpu0"]["ear.veraison.annotated-evidence"]["runtime_data_claims"] = {
        "tee-pubkey": other
    }
    with pytest.raises(AttestationError) as caught:
        verify_kbs_token(_sign(claims), keys=KEYS, audience=ISSUER, now=NOW)
    assert caught.value.code is ErrorCode.KBS_TOKEN_INVALID


def test_token_of_another_issuer_rejected() -> None:
    with pytest.raises(AttestationError) as caught:
        verify_kbs_token(_sign(_claims(iss="https://trustee")), keys=KEYS, audience=ISSUER, now=NOW)
    assert caught.value.code is ErrorCode.AUDIENCE_MISMATCH
    with pytest.raises(AttestationError) as expired:
        verify_kbs_token(_sign(_claims()), keys=KEYS, audience=ISSUER, now=NOW + timedelta(hours=1))
    assert expired.value.code is ErrorCode.TOKEN_EXPIRED


def test_a_held_token_is_checked_again_at_each_use() -> None:
    """The worker's cache (``decisions/kbs_cache.py``): verified once, its times at every use,
    verified again (and refused) once its key is retired; a stored entry that differs from
    what the token was signed for is refused even after another entry was checked."""
    cache = TokenCache()
    token = _sign(_claims())
    held = cache.verify(token, keys=KEYS, audience=ISSUER, now=NOW)
    assert cache.verify(token, keys=KEYS, audience=ISSUER, now=NOW) is held
    with pytest.raises(AttestationError) as expired:
        cache.verify(token, keys=KEYS, audience=ISSUER, now=NOW + timedelta(hours=1))
    assert expired.value.code is ErrorCode.TOKEN_EXPIRED
    rotated = {KID: ec.generate_private_key(ec.SECP256R1()).public_key()}
    with pytest.raises(AttestationError) as retired:
        cache.verify(token, keys=rotated, audience=ISSUER, now=NOW)
    assert retired.value.code is ErrorCode.TOKEN_SIGNATURE_INVALID
    entry = AttestationEntry(
        jti="jti-1", expires_at=NOW, pop_thumbprint=held.tee_thumbprint, policy_input={"a": 1}
    )
    with pytest.raises(UpstreamError) as mismatch:  # the token names another input digest
        held.stored_input(entry)
    assert mismatch.value.code is ErrorCode.ATTESTATION_STORE_MISMATCH

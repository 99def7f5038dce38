"""The token a Confidential Containers guest gets from ``POST /kbs/v0/attest`` (docs/kbs.md):
this broker's EAR (``ear.py``) with the guest's ``tee-pubkey`` where Trustee's tooling looks for
it, ``submods.cpu0["ear.veraison.annotated-evidence"].runtime_data_claims["tee-pubkey"]`` (Trustee
``kbs/src/token``: ``TOKEN_TEE_PUBKEY_PATH_EAR``), integer ``nbf`` and ``exp`` (the guest reads
only those), and no ``cnf``: it is a bearer token for the key it names, never a result a release
under DPoP accepts (``verify_ear`` requires ``cnf``), and a DPoP result is never one of these
(``verify_kbs_token`` requires the ``kbs`` member of the broker's claim).

A resource is released only wrapped to the named key, so a stolen token releases nothing to
anyone without that key's private half (made in the guest's TEE). Pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ec

from broker.attestation.ear import CLAIM, LEEWAY, Submod, ear_claims, verify_result
from broker.core.errors import AttestationError, ErrorCode
from broker.crypto import jose

ANNOTATED = "ear.veraison.annotated-evidence"  # Trustee's submodule member for runtime data
KBS_MEMBER = "kbs"  # in the broker's claim: the protocol and the guest's tee


@dataclass(frozen=True)
class PresentedKbsToken:
    """A KBS token this broker signed, verified (signature, times, issuer, shape)."""

    jti: str
    expires_at: datetime
    tee: str  # the guest's KBS tee name
    protocol: str
    tee_pubkey: Mapping[str, Any]  # as the guest sent it (validated when it attested)
    input_digest: str | None  # the stored attestation's claims, as verified
    kid: str
    times: Mapping[str, Any]  # exp, nbf, iat: checked again at each use (``check_kbs_times``)


def kbs_token_claims(
    *,
    issuer: str,
    jti: str,
    now: datetime,
    ttl: timedelta,
    not_after: datetime | None,
    nonce: str,
    verifier_build: str,
    submods: Sequence[Submod],
    tee_pubkey: Mapping[str, Any],
    tee: str,
    protocol: str,
    policy_digest: str,
    evidence_digests: Mapping[str, str],
    input_digest: str | None,
) -> dict[str, Any]:
    """The claims of a guest's token (``ear_claims`` without ``cnf``, for this broker as
    issuer and audience, never past ``not_after``: what the evidence was judged with expires),
    with ``nbf`` and the ``tee-pubkey`` where Trustee reads it.

    Raises:
        ValueError: as ``ear_claims``.
    """
    claims = ear_claims(
        issuer=issuer,
        audience=issuer,
        jti=jti,
        now=now,
        ttl=ttl,
        not_after=not_after,
        nonce=nonce,
        verifier_build=verifier_build,
        submods=submods,
        pop_jwk=None,
        encryption_jwk=tee_pubkey,
        policy_digest=policy_digest,
        evidence_digests=evidence_digests,
        input_digest=input_digest,
    )
    claims["nbf"] = claims["iat"]
    cpu = claims["submods"][submods[0].label]
    cpu[ANNOTATED] = {"runtime_data_claims": {"tee-pubkey": dict(tee_pubkey)}}
    claims[CLAIM][KBS_MEMBER] = {"protocol": protocol, "tee": tee}
    return claims


def verify_kbs_token(
    token: Any,
    *,
    keys: Mapping[str, ec.EllipticCurvePublicKey],
    audience: str,
    now: datetime,
) -> PresentedKbsToken:
    """A presented KBS token: one of this broker's results (``ear.verify_result``: key by
    ``kid``, ``typ``, signature, times, issuer and audience), made for a KBS guest (the ``kbs``
    member), naming one ``tee-pubkey`` in both places it is written.

    Raises:
        AttestationError: ``token_*`` codes; ``kbs_token_invalid`` for a result of ours that
            is not a KBS guest's token.
    """
    claims, kid = verify_result(
        token,
        keys=keys,
        audience=audience,
        now=now,
        required=("exp", "iat", "jti", "iss", "aud", CLAIM),
    )
    own = claims.get(CLAIM)
    own = own if isinstance(own, Mapping) else {}
    kbs, key = own.get(KBS_MEMBER), own.get("encryption_key")
    submods = claims.get("submods")
    cpu = submods.get("cpu0") if isinstance(submods, Mapping) else None
    annotated = cpu.get(ANNOTATED) if isinstance(cpu, Mapping) else None
    runtime = annotated.get("runtime_data_claims") if isinstance(annotated, Mapping) else None
    named = runtime.get("tee-pubkey") if isinstance(runtime, Mapping) else None
    if (
        not isinstance(kbs, Mapping)
        or not isinstance(kbs.get("tee"), str)
        or not isinstance(key, Mapping)
        or named != key
    ):
        raise AttestationError(
            "not a KBS token of this broker (attest through /kbs/v0/attest)",
            code=ErrorCode.KBS_TOKEN_INVALID,
        )
    digest = own.get("input_digest")
    return PresentedKbsToken(
        jti=claims["jti"],
        expires_at=datetime.fromtimestamp(float(claims["exp"]), UTC),
        tee=kbs["tee"],
        protocol=str(kbs.get("protocol")),
        tee_pubkey=dict(key),
        input_digest=digest if isinstance(digest, str) else None,
        kid=kid,
        times={name: claims[name] for name in ("exp", "nbf", "iat") if name in claims},
    )


def check_kbs_times(token: PresentedKbsToken, now: datetime) -> None:
    """``verify_kbs_token``'s time checks again at ``now``, for a token verified at an earlier
    request (``decisions/kbs_cache.py``).

    Raises:
        AttestationError: ``token_expired``, ``token_not_yet_valid``, ``token_issued_in_future``.
    """
    jose.check_times(token.times, now=now, leeway=LEEWAY)

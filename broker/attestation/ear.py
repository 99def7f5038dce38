"""EAT Attestation Results (EAR, draft-ietf-rats-ear-04): what ``POST /v1/attest`` answers.

An EAR says what the broker concluded about a runner's evidence, per attester, without the
evidence itself (digests only): the overall and per-submodule ``ear_status`` (AR4SI tiers:
``none`` < ``affirming`` < ``warning`` < ``contraindicated``), each submodule's
trustworthiness vector and the appraisal policies that produced it. Two claims make it ours:

* ``cnf.jwk`` (RFC 7800): the runner's proof-of-possession key. The EAR is not a bearer
  token: each use comes with a DPoP proof by that key (``crypto/dpop.py``).
* ``CLAIM`` (a private claim, RFC 7519 §4.3): the runner's encryption key (keys released on
  this EAR are wrapped to it), the digest and epoch of the policy that appraised it, and the
  evidence digests.

Submodule labels follow Trustee's scheme: ``cpu0`` for the CPU TEE, ``gpu0``, ``gpu1``, … for
GPUs in the order the evidence lists them. ``legacy=True`` writes the names Veraison's library
and Trustee's policies read (``ear.status``, ``ear.trustworthiness-vector``,
``ear.appraisal-policy-id``, ``ear.verifier-id``, profile ``tag:github.com,2023:veraison/ear``).

Pure: ``ear_claims`` builds the claims set from values, ``sign_ear`` makes the compact JWS with
a signing function (the result-signing key lives where KEKs live: a file, Cloud KMS or PKCS#11),
``verify_ear`` checks one presented back (our key by ``kid``, ``typ``, audience, times, a P-256
``cnf.jwk``) for a release on it.
``tests/unit/test_ear.py`` checks the claims against a JSON Schema written from the draft's
CDDL and verifies the signature with two JOSE libraries we do not sign with.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ec

from broker.core.encoding import b64url_encode
from broker.core.errors import AttestationError, ErrorCode
from broker.crypto import jose
from broker.crypto.jwk import thumbprint

EAR_PROFILE = "tag:ietf.org,2026:rats/ear#04"
LEGACY_PROFILE = "tag:github.com,2023:veraison/ear"
MEDIA_TYPE = f'application/eat+jwt; eat_profile="{EAR_PROFILE}"'
JWT_TYPE = "eat+jwt"
CLAIM = "urn:sealed-runner-broker:attestation"  # our one private claim (keys, policy, digests)
STATUSES = ("none", "affirming", "warning", "contraindicated")  # AR4SI tiers, best to worst
VECTOR_CLAIMS = (
    "instance-identity",
    "configuration",
    "executables",
    "file-system",
    "hardware",
    "runtime-opaque",
    "storage-opaque",
    "sourced-data",
)
MAX_TTL = timedelta(seconds=900)
LEEWAY = timedelta(seconds=5)  # clock skew tolerated on a presented result's times


@dataclass(frozen=True)
class Submod:
    """One attester's appraisal: its label (``cpu0``, ``gpu0``…), tier and vector."""

    label: str
    status: str
    vector: Mapping[str, int] = field(default_factory=dict)  # AR4SI claim -> value (-128..127)
    policy_ids: Sequence[str] = ()


def status_of(value: int) -> str:
    """The AR4SI tier of one trustworthiness value (draft-ietf-rats-ar4si §2.3.2)."""
    magnitude = abs(value)
    if magnitude <= 1:
        return "none"
    if magnitude <= 31:
        return "affirming"
    if magnitude <= 95:
        return "warning"
    return "contraindicated"


def worst_status(statuses: Iterable[str]) -> str:
    """The least favourable of these tiers (``none`` without one)."""
    return max(statuses, key=STATUSES.index, default="none")


def overall_status(submods: Sequence[Submod]) -> str:
    """The least favourable tier of any submodule (``none`` without one)."""
    return worst_status(s.status for s in submods)


def ear_claims(
    *,
    issuer: str,
    audience: str,
    jti: str,
    now: datetime,
    ttl: timedelta,
    not_after: datetime | None,
    nonce: str,
    verifier_build: str,
    submods: Sequence[Submod],
    pop_jwk: Mapping[str, str] | None,
    encryption_jwk: Mapping[str, str],
    policy_digest: str,
    evidence_digests: Mapping[str, str],
    input_digest: str | None = None,
    legacy: bool = False,
) -> dict[str, Any]:
    """The claims set. ``exp`` is ``now + ttl`` (at most ``MAX_TTL``) and never later than
    ``not_after``, the earliest expiry of any token or collateral the appraisal used. Without
    ``pop_jwk`` (a KBS guest's token, ``kbs_token_claims``) there is no ``cnf``: such a result
    can never pass ``verify_ear``, so it is never usable under DPoP.

    Raises:
        ValueError: an unknown tier or vector claim, a duplicate label, a TTL out of range, or
            evidence that had already expired (``not_after`` not after ``now``).
    """
    if not timedelta(0) < ttl <= MAX_TTL:
        raise ValueError(f"an EAR lives 1..{int(MAX_TTL.total_seconds())} s")
    labels = [s.label for s in submods]
    if not submods or len(set(labels)) != len(labels):
        raise ValueError("an EAR needs one submodule per attester, each labelled once")
    for submod in submods:
        if submod.status not in STATUSES:
            raise ValueError(f"unknown EAR status {submod.status!r}")
        unknown = sorted(set(submod.vector) - set(VECTOR_CLAIMS))
        if unknown:
            raise ValueError(f"unknown trustworthiness claims: {', '.join(unknown)}")
    expires = now + ttl if not_after is None else min(now + ttl, not_after)
    if expires <= now:
        raise ValueError("the evidence expires before an EAR could be used")
    names = _LEGACY if legacy else _CURRENT
    return {
        "eat_profile": LEGACY_PROFILE if legacy else EAR_PROFILE,
        "iss": issuer,
        "aud": audience,
        "jti": jti,
        "iat": int(now.timestamp()),
        "exp": int(expires.timestamp()),
        "eat_nonce": nonce,
        names["verifier"]: {"developer": issuer, "build": verifier_build},
        names["status"]: overall_status(submods),
        "submods": {
            s.label: {
                names["status"]: s.status,
                **({names["vector"]: dict(s.vector)} if s.vector else {}),
                **(_policy_ids(s.policy_ids, legacy) if s.policy_ids else {}),
            }
            for s in submods
        },
        **({"cnf": {"jwk": dict(pop_jwk)}} if pop_jwk is not None else {}),
        CLAIM: {
            "encryption_key": dict(encryption_jwk),
            "policy_digest": policy_digest,
            "evidence_digests": dict(evidence_digests),
            # the stored claims a release on this result is decided from, as verified: the
            # shared store is trusted for status, never for content
            **({"input_digest": input_digest} if input_digest is not None else {}),
        },
    }


def signing_input(claims: Mapping[str, Any], *, kid: str) -> str:
    """The JWS signing input (header ``alg`` ES256, ``kid``, ``typ`` eat+jwt, then the claims)."""
    return f"{_segment({'alg': 'ES256', 'kid': kid, 'typ': JWT_TYPE})}.{_segment(claims)}"


def compact(signing_input_text: str, signature: bytes) -> str:
    """The compact JWS of a signing input and its raw ES256 signature (R || S)."""
    if len(signature) != 64:
        raise ValueError("an ES256 signature is 64 bytes (R || S)")
    return f"{signing_input_text}.{b64url_encode(signature)}"


def sign_ear(claims: Mapping[str, Any], *, kid: str, sign: Callable[[bytes], bytes]) -> str:
    """The compact JWS (ES256) of ``claims``; ``sign`` returns the raw R || S signature of the
    signing input (a key in this process; a KMS or HSM key signs through ``signing_input`` and
    ``compact`` with an awaited call)."""
    text = signing_input(claims, kid=kid)
    return compact(text, sign(text.encode("ascii")))


_CURRENT = {
    "verifier": "ear_verifier_id",
    "status": "ear_status",
    "vector": "ear_trustworthiness_vector",
}
_LEGACY = {
    "verifier": "ear.verifier-id",
    "status": "ear.status",
    "vector": "ear.trustworthiness-vector",
}


def _policy_ids(ids: Sequence[str], legacy: bool) -> dict[str, Any]:
    # Veraison's library carries one policy id per submodule; the draft a list
    return (
        {"ear.appraisal-policy-id": ids[0]} if legacy else {"ear_appraisal_policy_ids": list(ids)}
    )


@dataclass(frozen=True)
class PresentedEar:
    """An EAR this broker signed, verified: what a release on it needs."""

    jti: str
    pop_thumbprint: str  # RFC 7638 thumbprint of ``cnf.jwk``: DPoP proofs must be by this key
    expires_at: datetime
    claims: Mapping[str, Any]
    kid: str = ""  # the result key it verified with (one of ``verify_ear``'s ``keys``)


def verify_ear(
    token: Any,
    *,
    keys: Mapping[str, ec.EllipticCurvePublicKey],
    audience: str,
    now: datetime,
) -> PresentedEar:
    """Verify a presented EAR: signed ES256 by one of this broker's result keys (chosen by
    ``kid``; ``keys`` holds the current and any previous key still within a TTL), typed
    ``eat+jwt``, for ``audience`` (``iss`` and ``aud``), not expired, at most ``MAX_TTL`` long,
    bound to a P-256 ``cnf.jwk``. The one JWS verifier (``crypto/jose.py``) checks signature and
    times; nothing else in the token is trusted before it has.

    Raises:
        AttestationError: ``token_*`` codes naming the check that failed.
    """
    claims, kid = verify_result(
        token,
        keys=keys,
        audience=audience,
        now=now,
        required=("exp", "iat", "jti", "iss", "aud", "cnf"),
    )
    cnf = claims.get("cnf")
    jwk = cnf.get("jwk") if isinstance(cnf, Mapping) else None
    if not isinstance(jwk, Mapping) or jwk.get("kty") != "EC" or jwk.get("crv") != "P-256":
        raise AttestationError("the result names no P-256 proof-of-possession key")
    members = {name: str(jwk.get(name)) for name in ("crv", "kty", "x", "y")}
    return PresentedEar(
        jti=claims["jti"],
        pop_thumbprint=thumbprint(members),
        expires_at=datetime.fromtimestamp(float(claims["exp"]), UTC),
        claims=claims,
        kid=kid,
    )


def verify_result(
    token: Any,
    *,
    keys: Mapping[str, ec.EllipticCurvePublicKey],
    audience: str,
    now: datetime,
    required: Sequence[str],
) -> tuple[dict[str, Any], str]:
    """The checks every result this broker signed passes, whatever it is used for (a release
    under DPoP: ``verify_ear``; a KBS guest's token: ``kbs_token.verify_kbs_token``): this
    broker's result key by ``kid``, ``typ``, signature and times (``crypto/jose.py``), the
    ``required`` claims, ``iss`` and ``aud``, a ``jti``. Its claims and the ``kid``.

    Raises:
        AttestationError: ``token_*`` codes naming the check that failed.
    """
    if not isinstance(token, str) or not token:
        raise AttestationError("an attestation result is required")
    header = jose.parse_header_with_kid(token, ("ES256",))
    if header.fields.get("typ") != JWT_TYPE:
        raise AttestationError(f"not an attestation result (typ must be {JWT_TYPE})")
    key = keys.get(str(header.kid))
    if key is None:
        raise AttestationError(
            "the result was not signed by this broker's result key",
            code=ErrorCode.TOKEN_KEY_UNKNOWN,
        )
    claims = jose.verify_jws(
        token,
        header,
        key,
        now=now,
        leeway=LEEWAY,
        required_claims=required,
        max_lifetime=MAX_TTL,
    ).claims
    if claims.get("iss") != audience or claims.get("aud") != audience:
        raise AttestationError(
            "the result was issued for another broker", code=ErrorCode.AUDIENCE_MISMATCH
        )
    jti = claims.get("jti")
    if not isinstance(jti, str) or not jti:
        raise AttestationError("the result has no jti", code=ErrorCode.TOKEN_CLAIM_INVALID)
    return dict(claims), str(header.kid)


def check_ear_times(ear: PresentedEar, now: datetime) -> None:
    """``verify_ear``'s time checks (``exp``, ``nbf``, ``iat``, with ``LEEWAY``) again at
    ``now``, for a result that verified at an earlier request (``decisions/attested_cache.py``).

    Raises:
        AttestationError: ``token_expired``, ``token_not_yet_valid``, ``token_issued_in_future``.
    """
    jose.check_times(ear.claims, now=now, leeway=LEEWAY)


def _segment(value: Mapping[str, Any]) -> str:
    return b64url_encode(json.dumps(value, separators=(",", ":"), sort_keys=True).encode())

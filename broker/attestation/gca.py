"""Google Cloud Attestation (Confidential Space) OIDC token verifier. Pure.

Checklist (../shared/EVIDENCE.md §1.4, Google "Attestation token validation endpoint fields"):

1. Parse the JOSE header: ``alg`` in the issuer's allow-list (RS256 for Google), no
   ``jku``/``x5u``/``jwk``/``crit``; ``kid`` present; no ``x5c`` (PKI tokens are a separate path).
2. Select the signing key by ``kid`` from the configured key set only; a key whose own ``alg``
   differs from the header's is refused.
3. Verify the RSASSA-PKCS1-v1_5/SHA-256 signature over ``header.payload``.
4. Check ``exp``/``nbf``/``iat`` against the injected ``now`` with one leeway.
5. ``iss`` equals the configured issuer exactly.
6. ``aud`` equals the broker's audience (a string, or an array containing it).

Binding to the broker nonce and the runner key is checked by ``binding.check_eat_nonce``.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from broker.attestation import jose
from broker.attestation.jwks import TrustedKeySet
from broker.errors import AttestationError, ErrorCode

REQUIRED_CLAIMS = ("iss", "aud", "exp", "iat")


@dataclass(frozen=True)
class VerifiedGcaToken:
    """A Confidential Space token whose signature, issuer, audience and times verified."""

    issuer: str
    kid: str
    claims: Mapping[str, Any]


def unverified_issuer(token: str) -> str | None:
    """Read ``iss`` without verifying, only to choose which configured issuer to verify with."""
    parts = token.split(".")
    if len(parts) != 3 or len(token) > jose.MAX_TOKEN_BYTES:
        return None
    try:
        unverified_claims = json.loads(jose.b64url_decode(parts[1]))
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(unverified_claims, dict):
        return None
    iss = unverified_claims.get("iss")
    return iss if isinstance(iss, str) else None


def parse_gca_header(token: str, algorithms: Collection[str]) -> jose.UnverifiedHeader:
    """Step 1: the header checks. The async layer calls it to learn which ``kid`` to fetch.

    Raises:
        AttestationError: as ``jose.parse_header``, or ``token_malformed`` without a kid, or
            ``token_header_forbidden`` for a PKI (``x5c``) token.
    """
    header = jose.parse_header(token, algorithms)
    if "x5c" in header.fields:
        raise AttestationError(
            "x5c (PKI) tokens are not accepted by this issuer entry",
            code=ErrorCode.TOKEN_HEADER_FORBIDDEN,
        )
    if not header.kid:
        raise AttestationError("token header has no kid")
    return header


def verify_gca_token(
    token: str,
    *,
    issuer: str,
    algorithms: Collection[str],
    keys: TrustedKeySet,
    audience: str,
    now: datetime,
    leeway: timedelta = jose.DEFAULT_LEEWAY,
) -> VerifiedGcaToken:
    """Verify a Confidential Space OIDC token (steps 1-6 above).

    Args:
        token: the compact JWT as presented by the runner.
        issuer: the configured issuer URL, compared exactly with ``iss``.
        algorithms: the issuer's allowed signature algorithms.
        keys: the issuer's trusted key set (from configuration, never from the token).
        audience: the broker's audience.
        now: the one clock reading of this request.
        leeway: clock skew tolerated on the time claims.

    Raises:
        AttestationError: with the specific code of the first failed step.
    """
    header = parse_gca_header(token, algorithms)
    trusted = keys.get(header.kid)
    if trusted is None:
        raise AttestationError(
            "token is signed by a key the issuer does not publish",
            code=ErrorCode.TOKEN_KEY_UNKNOWN,
        )
    if trusted.alg is not None and trusted.alg != header.alg:
        raise AttestationError(
            "token alg differs from the alg of its signing key",
            code=ErrorCode.TOKEN_ALGORITHM_FORBIDDEN,
        )
    verified = jose.verify_jws(
        token, header, trusted.key, now=now, leeway=leeway, required_claims=REQUIRED_CLAIMS
    )
    claims = verified.claims
    if claims.get("iss") != issuer:
        raise AttestationError(
            "token issuer is not the configured one", code=ErrorCode.ISSUER_UNKNOWN
        )
    if not _audience_matches(claims.get("aud"), audience):
        raise AttestationError(
            "token audience is not this broker", code=ErrorCode.AUDIENCE_MISMATCH
        )
    return VerifiedGcaToken(issuer=issuer, kid=trusted.kid, claims=claims)


def _audience_matches(aud: Any, expected: str) -> bool:
    if isinstance(aud, str):
        return aud == expected
    return isinstance(aud, list) and expected in aud and all(isinstance(a, str) for a in aud)

"""JWS verification against configured trust: keys chosen by ``kid``/``alg`` from a configured
key set, keys whose ``x5c`` must chain to a pinned root, and the issuer/audience check. Generic
JOSE, shared by every token verifier (Confidential Space, Intel Trust Authority, NVIDIA NRAS):
it lives here, not in ``attestation/``, so that ``attestation/nvidia/`` needs nothing from the
package that imports it (issue 30)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from cryptography import x509

from broker.core.errors import AttestationError, ErrorCode
from broker.crypto import jose
from broker.crypto.jwk import public_jwk
from broker.crypto.jwks import TrustedKey, TrustedKeySet
from broker.crypto.x509chain import load_der, verify_chain


def select_key(keys: TrustedKeySet, header: jose.UnverifiedHeader) -> TrustedKey:
    """The configured key named by ``kid`` whose own ``alg`` (if any) is the header's.

    Raises:
        AttestationError: ``token_key_unknown`` or ``token_algorithm_forbidden``.
    """
    trusted = keys.get(header.kid, header.alg)
    if trusted is not None:
        return trusted
    if keys.has_kid(header.kid):
        raise AttestationError(
            "token alg differs from the alg of its signing key",
            code=ErrorCode.TOKEN_ALGORITHM_FORBIDDEN,
        )
    raise AttestationError(
        "token is signed by a key the issuer does not publish", code=ErrorCode.TOKEN_KEY_UNKNOWN
    )


def check_issuer_and_audience(
    claims: Mapping[str, Any], *, issuer: str, audience: str | None
) -> None:
    """Steps 5 and 6 (``audience=None``: the caller decided ``aud`` is not required).

    Raises:
        AttestationError: ``issuer_unknown`` or ``audience_mismatch``.
    """
    if claims.get("iss") != issuer:
        raise AttestationError(
            "token issuer is not the configured one", code=ErrorCode.ISSUER_UNKNOWN
        )
    if audience is None:
        return
    aud = claims.get("aud")
    matches = aud == audience or (
        isinstance(aud, list) and audience in aud and all(isinstance(a, str) for a in aud)
    )
    if not matches:
        raise AttestationError(
            "token audience is not this broker", code=ErrorCode.AUDIENCE_MISMATCH
        )


def verify_pinned_jws(
    token: str,
    *,
    algorithms: Collection[str],
    keys: TrustedKeySet,
    anchors: Sequence[x509.Certificate],
    now: datetime,
    leeway: timedelta,
    tolerated_jku: Collection[str] = (),
    max_lifetime: timedelta = jose.DEFAULT_MAX_LIFETIME,
) -> jose.VerifiedJws:
    """Header checks, key by ``kid``/``alg`` whose ``x5c`` chains to a pinned anchor, then the
    signature and times (the common part of ITA and NRAS token verification).

    Raises:
        AttestationError: with the specific code of the first failed check.
    """
    header = jose.parse_header_with_kid(token, algorithms, tolerated_jku=tolerated_jku)
    trusted = select_key(keys, header)
    check_key_chain(trusted, anchors, now=now)
    return jose.verify_jws(
        token,
        header,
        trusted.key,
        now=now,
        leeway=leeway,
        required_claims=("iss", "exp", "iat"),
        max_lifetime=max_lifetime,
    )


def check_key_chain(
    trusted: TrustedKey, roots: Sequence[x509.Certificate], *, now: datetime
) -> None:
    """A published key is usable only if its ``x5c`` chains to a pinned root and names it.

    Raises:
        AttestationError: ``cert_chain_invalid``.
    """
    if not trusted.x5c:
        raise AttestationError(
            "the signing key carries no x5c chain", code=ErrorCode.CERT_CHAIN_INVALID
        )
    chain = [load_der(der) for der in trusted.x5c]
    verify_chain(chain[0], [c for c in chain[1:] if c not in roots], roots, now=now)
    if public_jwk(chain[0].public_key()) != public_jwk(trusted.key):  # type: ignore[arg-type]
        raise AttestationError(
            "the JWK is not the key of its x5c leaf", code=ErrorCode.CERT_CHAIN_INVALID
        )

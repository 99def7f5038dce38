"""Google Cloud Attestation (Confidential Space) token verifier, OIDC and PKI. Pure.

Checklist (../shared/docs/evidence.md; Google "Attestation token validation endpoint fields"):

1. Parse the JOSE header: ``alg`` in the issuer's allow-list (RS256 for Google), no
   ``jku``/``x5u``/``jwk``/``crit``. A header with ``x5c`` is a PKI token, one without an OIDC
   token; each kind is accepted only if the issuer entry enables it.
2. OIDC: select the signing key by ``kid`` from the configured key set only; a key whose own
   ``alg`` differs from the header's is refused.
   PKI: ``x5c`` holds leaf, intermediate, root (standard base64 DER); the chain must validate at
   ``now`` to the pinned Confidential Space root (never to a root the token brings), the leaf
   key must be RSA, and ``kid`` must equal the RFC 7638 thumbprint of the leaf key.
3. Verify the RSASSA-PKCS1-v1_5/SHA-256 signature over ``header.payload``.
4. Check ``exp``/``nbf``/``iat`` against the injected ``now`` with one leeway.
5. ``iss`` equals the configured issuer exactly.
6. ``aud`` equals the broker's audience (a string, or an array containing it).

Binding to the broker nonce and the runner key is checked by ``binding.check_eat_nonce``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import rsa

from broker.core.errors import AttestationError, ErrorCode
from broker.crypto import jose
from broker.crypto.jwk import public_jwk, thumbprint
from broker.crypto.jwks import MAX_X5C, TrustedKeySet
from broker.crypto.pinned import check_issuer_and_audience, select_key
from broker.crypto.x509chain import load_b64_der, verify_chain

REQUIRED_CLAIMS = ("iss", "aud", "exp", "iat")
TOKEN_TYPES = frozenset({"oidc", "pki"})


@dataclass(frozen=True)
class VerifiedGcaToken:
    """A Confidential Space token whose signature, issuer, audience and times verified."""

    issuer: str
    kid: str
    claims: Mapping[str, Any]
    token_type: str = "oidc"  # noqa: S105 - a token kind


@dataclass(frozen=True)
class GcaTrust:
    """What an issuer entry trusts: an OIDC key set, PKI roots, or both."""

    issuer: str
    algorithms: Collection[str]
    keys: TrustedKeySet | None = None  # OIDC
    roots: Sequence[x509.Certificate] = ()  # PKI
    tolerated_jku: Collection[str] = ()
    max_lifetime: timedelta = jose.DEFAULT_MAX_LIFETIME


def verify_gca_token(
    token: str,
    *,
    trust: GcaTrust,
    audience: str | None,
    now: datetime,
    leeway: timedelta = jose.DEFAULT_LEEWAY,
) -> VerifiedGcaToken:
    """Verify a Confidential Space token (steps 1-6 above).

    Args:
        token: the compact JWT as presented by the runner.
        trust: the issuer entry's trust material (from configuration, never from the token).
        audience: the broker's audience (``None`` skips the check: offline CLI only).
        now: the one clock reading of this request.
        leeway: clock skew tolerated on the time claims.

    Raises:
        AttestationError: with the specific code of the first failed step.
    """
    header = jose.parse_header_with_kid(token, trust.algorithms, tolerated_jku=trust.tolerated_jku)
    if "x5c" in header.fields:
        if not trust.roots:
            raise AttestationError(
                "x5c (PKI) tokens are not accepted by this issuer entry",
                code=ErrorCode.TOKEN_HEADER_FORBIDDEN,
            )
        key: Any = pki_signing_key(header, trust.roots, now=now)
        token_type = "pki"  # noqa: S105 - a token kind
    else:
        if trust.keys is None:
            raise AttestationError(
                "OIDC tokens are not accepted by this issuer entry; send a PKI token",
                code=ErrorCode.TOKEN_HEADER_FORBIDDEN,
            )
        key = select_key(trust.keys, header).key
        token_type = "oidc"  # noqa: S105 - a token kind
    verified = jose.verify_jws(
        token,
        header,
        key,
        now=now,
        leeway=leeway,
        required_claims=REQUIRED_CLAIMS,
        max_lifetime=trust.max_lifetime,
    )
    check_issuer_and_audience(verified.claims, issuer=trust.issuer, audience=audience)
    return VerifiedGcaToken(
        issuer=trust.issuer, kid=str(header.kid), claims=verified.claims, token_type=token_type
    )


def pki_signing_key(
    header: jose.UnverifiedHeader, roots: Sequence[x509.Certificate], *, now: datetime
) -> rsa.RSAPublicKey:
    """Step 2 (PKI): validate ``x5c`` to the pinned roots and return the leaf's key.

    Raises:
        AttestationError: ``token_malformed``, ``cert_chain_invalid`` or ``kid_mismatch``.
    """
    x5c = header.fields.get("x5c")
    if (
        not isinstance(x5c, list)
        or not 2 <= len(x5c) <= MAX_X5C
        or not all(isinstance(entry, str) for entry in x5c)
    ):
        raise AttestationError("x5c must list the leaf, intermediate and root certificates")
    chain = [load_b64_der(str(entry)) for entry in x5c]
    # The root the token brings is only a hint: validation ends at the pinned root or fails.
    intermediates = [c for c in chain[1:] if c not in roots]
    verify_chain(chain[0], intermediates, roots, now=now)
    leaf_key = chain[0].public_key()
    if not isinstance(leaf_key, rsa.RSAPublicKey) or leaf_key.key_size < 2048:
        raise AttestationError(
            "PKI token leaf key is not RSA-2048 or larger", code=ErrorCode.CERT_CHAIN_INVALID
        )
    if header.kid != thumbprint(public_jwk(leaf_key)):
        raise AttestationError(
            "kid is not the RFC 7638 thumbprint of the leaf key", code=ErrorCode.KID_MISMATCH
        )
    return leaf_key

"""Intel Trust Authority token verifier. Pure.

Checklist (docs/evidence.md; intel/trustauthority-client-for-go token.go VerifyToken):

1. Parse the header: ``alg`` PS384 or RS256 (as configured); ``jku`` tolerated only when it is
   exactly the configured Intel certs URL (never fetched); no ``x5u``/``jwk``/``crit``.
2. Select the key by ``kid`` (and ``alg``: Intel publishes each key twice) from the configured
   ITA key set. The key must carry ``x5c``; that chain must validate at ``now`` to the pinned
   Intel Trust Authority root (Intel's clients trust the root inside the JWKS; we do not), and
   the leaf's public key must be the JWK's key.
3. Verify the signature (RSASSA-PSS SHA-384 salt 48, or PKCS#1 v1.5 SHA-256) and the times.
4. ``iss`` equals the configured issuer. ``aud``, when present (tokens issued through
   Confidential Space carry it), equals the broker's audience; ITA's own TDX tokens have none,
   so for them the nonce binding below is what stops replay.
5. Binding (``check_ita_binding``): a Confidential Space-shaped token binds through
   ``eat_nonce`` like a Google token; a TDX token binds through held data:
   ``attester_held_data == SHA-256(nonce || thumbprint)`` and
   ``tdx_report_data[0:64] == SHA-512(verifier_nonce.val || verifier_nonce.iat || held data)``
   (``SHA-512(held data)`` without a verifier nonce) — the formula Intel's clients use to fill
   REPORTDATA, checked here again so the quote, not just the token, carries the binding.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from cryptography import x509

from broker.core import binding
from broker.core.errors import AttestationError, ErrorCode
from broker.crypto import jose
from broker.crypto.jwks import TrustedKeySet
from broker.crypto.pinned import check_issuer_and_audience, verify_pinned_jws

INTEL_CERTS_URL = "https://portal.trustauthority.intel.com/certs"


@dataclass(frozen=True)
class VerifiedItaToken:
    issuer: str
    kid: str
    claims: Mapping[str, Any]


@dataclass(frozen=True)
class ItaTrust:
    issuer: str
    algorithms: Collection[str]
    keys: TrustedKeySet
    roots: Sequence[x509.Certificate]
    tolerated_jku: Collection[str] = (INTEL_CERTS_URL,)
    max_lifetime: timedelta = jose.DEFAULT_MAX_LIFETIME


def verify_ita_token(
    token: str,
    *,
    trust: ItaTrust,
    audience: str | None,
    now: datetime,
    leeway: timedelta = jose.DEFAULT_LEEWAY,
) -> VerifiedItaToken:
    """Steps 1-4 above.

    Raises:
        AttestationError: with the specific code of the first failed step.
    """
    verified = verify_pinned_jws(
        token,
        algorithms=trust.algorithms,
        keys=trust.keys,
        anchors=trust.roots,
        now=now,
        leeway=leeway,
        tolerated_jku=trust.tolerated_jku,
        max_lifetime=trust.max_lifetime,
    )
    claims = verified.claims
    check_issuer_and_audience(
        claims, issuer=trust.issuer, audience=audience if "aud" in claims else None
    )  # ``audience=None`` (offline CLI) skips it too
    return VerifiedItaToken(issuer=trust.issuer, kid=str(verified.header["kid"]), claims=claims)


def tdx_claims(claims: Mapping[str, Any]) -> Mapping[str, Any]:
    """The TDX claim set: top level in v1 tokens, under ``tdx`` in v2 tokens."""
    nested = claims.get("tdx")
    if isinstance(nested, dict) and any(str(k).startswith("tdx_") for k in nested):
        return nested
    return claims


def check_ita_binding(claims: Mapping[str, Any], *, nonce: str, thumbprint: str) -> None:
    """Step 5 above.

    Raises:
        AttestationError: ``nonce_missing``, ``nonce_mismatch``, ``key_binding_mismatch`` or
            ``token_claim_invalid``.
    """
    if "eat_nonce" in claims or "submods" in claims:
        binding.check_eat_nonce(claims.get("eat_nonce"), nonce=nonce, thumbprint=thumbprint)
        return
    check_gpu_nonce(claims)
    held = held_data(claims)
    if not binding.same_bytes(held, binding.binding_digest(nonce, thumbprint)):
        raise AttestationError(
            "held data is not SHA-256(nonce || runner key thumbprint)",
            code=ErrorCode.KEY_BINDING_MISMATCH,
        )
    check_report_data(claims, held)


def held_data(claims: Mapping[str, Any]) -> bytes:
    """The decoded ``attester_held_data`` (v1 top level or v2 under ``tdx``).

    Raises:
        AttestationError: ``nonce_missing`` when absent, ``token_claim_invalid`` when not base64.
    """
    tdx = tdx_claims(claims)
    held = _b64(claims.get("attester_held_data") or tdx.get("attester_held_data"), "held data")
    if held is None:
        raise AttestationError(
            "token carries no attester_held_data; send SHA-256(nonce || thumbprint) as user data",
            code=ErrorCode.NONCE_MISSING,
        )
    return held


def check_gpu_nonce(claims: Mapping[str, Any]) -> None:
    """GPU results inside an ITA token must come from the same appraisal as the TD quote.

    Intel's client derives the GPU nonce as ``SHA-256(verifier_nonce.val || verifier_nonce.iat)``
    (docs/evidence.md, §3.6); when the token states a GPU ``eat_nonce`` it must be that value.

    Raises:
        AttestationError: ``nonce_mismatch``.
    """
    nvgpu = claims.get("nvgpu")
    stated = nvgpu.get("eat_nonce") if isinstance(nvgpu, dict) else None
    verifier_nonce = claims.get("verifier_nonce") or tdx_claims(claims).get("verifier_nonce")
    if stated is None or not isinstance(verifier_nonce, dict):
        return
    val = _b64(verifier_nonce.get("val"), "verifier_nonce.val") or b""
    iat = _b64(verifier_nonce.get("iat"), "verifier_nonce.iat") or b""
    expected = hashlib.sha256(val + iat).hexdigest()
    if not binding.same_bytes(str(stated).lower().encode(), expected.encode()):
        raise AttestationError(
            "the token's GPU result was made for another appraisal (nvgpu eat_nonce)",
            code=ErrorCode.NONCE_MISMATCH,
        )


def check_report_data(claims: Mapping[str, Any], held: bytes) -> None:
    """REPORTDATA[0:64] must be Intel's hash over the verifier nonce and the held data.

    Raises:
        AttestationError: ``key_binding_mismatch`` or ``token_claim_invalid``.
    """
    tdx = tdx_claims(claims)
    report_hex = tdx.get("tdx_report_data")
    try:
        report = bytes.fromhex(str(report_hex))
    except ValueError as exc:
        raise AttestationError(
            "tdx_report_data is not hex", code=ErrorCode.TOKEN_CLAIM_INVALID
        ) from exc
    verifier_nonce = claims.get("verifier_nonce") or tdx.get("verifier_nonce")
    prefix = b""
    if isinstance(verifier_nonce, dict):
        val = _b64(verifier_nonce.get("val"), "verifier_nonce.val") or b""
        iat = _b64(verifier_nonce.get("iat"), "verifier_nonce.iat") or b""
        prefix = val + iat
    expected = hashlib.sha512(prefix + held).digest()
    if len(report) != 64 or not binding.same_bytes(report, expected):
        raise AttestationError(
            "the TD quote's REPORTDATA does not carry the held data",
            code=ErrorCode.KEY_BINDING_MISMATCH,
        )


def _b64(value: Any, name: str) -> bytes | None:
    if value is None:
        return None
    try:
        return base64.b64decode(str(value), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise AttestationError(f"{name} is not base64", code=ErrorCode.TOKEN_CLAIM_INVALID) from exc

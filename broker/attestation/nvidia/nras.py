"""NVIDIA Remote Attestation Service (NRAS) detached-EAT verifier. Pure.

Checklist (docs/evidence.md; real capture 2026-09-16):

1. Shape: ``[["JWT", overall], {"GPU-0": detached, …}]`` with 1..MAX_GPUS detached tokens.
2. Every token: header ``alg`` ES384 (as configured), ``kid`` from the configured NRAS key set;
   that key's ``x5c`` must validate at ``now`` to the pinned NRAS intermediate (NVIDIA's root is
   not published, so the intermediate is the anchor) and the leaf must carry the JWK's key
   (NVIDIA's own SDKs skip this chain check). Then ES384 signature and times; ``iss`` exact.
3. Overall token: ``eat_nonce`` equals the expected GPU nonce (hex, case-insensitive);
   ``submods`` names exactly the detached tokens, each as
   ``["DIGEST", ["SHA-256", hex(SHA-256(detached token string))]]``.
4. Each detached token: ``eat_nonce`` equals the same nonce.

NRAS's verdicts (``x-nvidia-overall-att-result``, ``measres``, ``dbgstat``, cert statuses) are
claims for the policy, normalised by ``claims.nras_gpu_entries``; they are not errors here.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from cryptography import x509

from broker.core.errors import AttestationError, ErrorCode
from broker.core.jsonsafe import loads_bounded
from broker.crypto import jose
from broker.crypto.jwks import TrustedKeySet
from broker.crypto.pinned import check_issuer_and_audience, verify_pinned_jws

MAX_GPUS = 8
MAX_EAT_BYTES = 256 * 1024


@dataclass(frozen=True)
class NrasTrust:
    issuer: str
    algorithms: Collection[str]
    keys: TrustedKeySet
    anchors: Sequence[x509.Certificate]  # the pinned NRAS intermediate
    max_lifetime: timedelta = jose.DEFAULT_MAX_LIFETIME


@dataclass(frozen=True)
class VerifiedNrasResult:
    overall: Mapping[str, Any]
    gpus: Mapping[str, Mapping[str, Any]]  # "GPU-0" -> detached claims


def parse_detached_eat(unverified: Any) -> tuple[str, dict[str, str]]:
    """Step 1: the overall token and the detached tokens by name.

    Raises:
        AttestationError: ``evidence_malformed``.
    """
    if isinstance(unverified, str):
        if len(unverified) > MAX_EAT_BYTES:
            raise AttestationError("NRAS result too large", code=ErrorCode.EVIDENCE_MALFORMED)
        try:
            unverified = loads_bounded(unverified)
        except ValueError as exc:
            raise AttestationError(
                "NRAS result is not JSON", code=ErrorCode.EVIDENCE_MALFORMED
            ) from exc
    shape_ok = (
        isinstance(unverified, list)
        and len(unverified) == 2
        and isinstance(unverified[0], list)
        and len(unverified[0]) == 2
        and unverified[0][0] == "JWT"
        and isinstance(unverified[0][1], str)
        and isinstance(unverified[1], dict)
        and 1 <= len(unverified[1]) <= MAX_GPUS
        and unverified[0][1].isascii()
        and all(
            isinstance(k, str) and isinstance(v, str) and v.isascii() and len(k) <= 64
            for k, v in unverified[1].items()
        )
    )
    if not shape_ok:
        raise AttestationError(
            'NRAS result must be [["JWT", overall], {"GPU-0": token, …}]',
            code=ErrorCode.EVIDENCE_MALFORMED,
        )
    return unverified[0][1], dict(unverified[1])


def verify_nras(
    unverified: Any,
    *,
    trust: NrasTrust,
    expected_nonce: bytes | None,
    now: datetime,
    leeway: timedelta = jose.DEFAULT_LEEWAY,
) -> VerifiedNrasResult:
    """Steps 1-4 above. ``expected_nonce=None`` skips the nonce checks (offline CLI only).

    Raises:
        AttestationError: with the specific code of the first failed step.
    """
    overall_token, detached = parse_detached_eat(unverified)
    overall = _verify_token(overall_token, trust, now=now, leeway=leeway)
    _check_nonce(overall, expected_nonce, "overall")
    submods = overall.get("submods")
    if not isinstance(submods, dict) or set(submods) != set(detached):
        raise AttestationError(
            "overall token submods do not name exactly the detached GPU tokens",
            code=ErrorCode.SUBMOD_DIGEST_MISMATCH,
        )
    gpus: dict[str, Mapping[str, Any]] = {}
    for name, token in sorted(detached.items()):
        expected = ["DIGEST", ["SHA-256", hashlib.sha256(token.encode("ascii")).hexdigest()]]
        if not _digest_equal(submods[name], expected):
            raise AttestationError(
                f"{name}: detached token does not match the overall token's digest",
                code=ErrorCode.SUBMOD_DIGEST_MISMATCH,
            )
        claims = _verify_token(token, trust, now=now, leeway=leeway)
        _check_nonce(claims, expected_nonce, name)
        gpus[name] = claims
    return VerifiedNrasResult(overall=overall, gpus=gpus)


def _verify_token(
    token: str, trust: NrasTrust, *, now: datetime, leeway: timedelta
) -> Mapping[str, Any]:
    verified = verify_pinned_jws(
        token,
        algorithms=trust.algorithms,
        keys=trust.keys,
        anchors=trust.anchors,
        now=now,
        leeway=leeway,
        max_lifetime=trust.max_lifetime,
    )
    check_issuer_and_audience(verified.claims, issuer=trust.issuer, audience=None)
    return verified.claims


def _check_nonce(claims: Mapping[str, Any], expected: bytes | None, name: str) -> None:
    if expected is None:
        return
    value = claims.get("eat_nonce")
    if not isinstance(value, str) or not value:
        raise AttestationError(f"{name}: no eat_nonce", code=ErrorCode.NONCE_MISSING)
    if not hmac.compare_digest(value.lower().encode(), expected.hex().encode()):
        raise AttestationError(
            f"{name}: eat_nonce is not SHA-256(nonce || runner key thumbprint)",
            code=ErrorCode.NONCE_MISMATCH,
        )


def _digest_equal(found: Any, expected: list[Any]) -> bool:
    if not (isinstance(found, list) and len(found) == 2 and isinstance(found[1], list)):
        return False
    if found[0] != "DIGEST" or len(found[1]) != 2 or found[1][0] != "SHA-256":
        return False
    return hmac.compare_digest(str(found[1][1]).lower().encode(), expected[1][1].encode())

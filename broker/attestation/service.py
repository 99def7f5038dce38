"""The async layer around the pure verifiers: picks trust anchors, fetches keys, then verifies.

All I/O (JWKS fetches) happens here; each verifier it calls is pure. New evidence kinds plug in
by adding a handler to ``EvidenceVerifier._handlers``; the release path sees only
``VerifiedEvidence``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from broker.attestation import binding, gca
from broker.attestation.claims import gca_tee
from broker.attestation.jwks import JwksSource
from broker.config import IssuerSettings
from broker.errors import AttestationError, ErrorCode, InputError

MAX_EVIDENCE_PIECES = 4


@dataclass(frozen=True)
class TrustedIssuer:
    settings: IssuerSettings
    keys: JwksSource


@dataclass(frozen=True)
class VerifiedEvidence:
    """Everything the release path learns from verified evidence."""

    tee: Mapping[str, Any]
    raw_claims: Mapping[str, Mapping[str, Any]]
    identity: Mapping[str, Any]  # the identity claims recorded in the decision log


def evidence_digests(unverified_evidence: Mapping[str, Any]) -> dict[str, str]:
    """SHA-256 of each piece of evidence as sent, for the decision log (never the raw token)."""
    return {
        kind: "sha256:" + hashlib.sha256(str(value).encode("utf-8")).hexdigest()
        for kind, value in sorted(unverified_evidence.items())
    }


class EvidenceVerifier:
    """Verifies the ``evidence`` member of a release request."""

    def __init__(
        self, issuers: Mapping[str, TrustedIssuer], *, audience: str, leeway: timedelta
    ) -> None:
        self._issuers = dict(issuers)
        self._audience = audience
        self._leeway = leeway
        self._handlers: dict[
            str, Callable[[Any, str, str, datetime], Awaitable[VerifiedEvidence]]
        ] = {"gca": self._verify_gca}

    @property
    def kinds(self) -> frozenset[str]:
        return frozenset(self._handlers)

    async def verify(
        self, unverified_evidence: Any, *, nonce: str, thumbprint: str, now: datetime
    ) -> VerifiedEvidence:
        """Verify every piece of evidence and its binding to ``nonce`` and ``thumbprint``.

        Raises:
            InputError: ``bad_request`` or ``evidence_unsupported`` for the wrong shape.
            AttestationError: when a piece does not verify or is not bound.
            UpstreamError: when trust material cannot be fetched.
        """
        if not isinstance(unverified_evidence, dict) or not unverified_evidence:
            raise InputError("evidence must be a non-empty object")
        if len(unverified_evidence) > MAX_EVIDENCE_PIECES:
            raise InputError("too many pieces of evidence")
        unknown = sorted(set(unverified_evidence) - set(self._handlers))
        if unknown:
            raise InputError(
                f"unsupported evidence kinds: {', '.join(unknown)}",
                code=ErrorCode.EVIDENCE_UNSUPPORTED,
            )
        (kind, value), *rest = sorted(unverified_evidence.items())
        if rest:
            raise InputError(
                "exactly one piece of CPU evidence is accepted", code=ErrorCode.EVIDENCE_UNSUPPORTED
            )
        return await self._handlers[kind](value, nonce, thumbprint, now)

    async def _verify_gca(
        self, token: Any, nonce: str, thumbprint: str, now: datetime
    ) -> VerifiedEvidence:
        if not isinstance(token, str) or not token:
            raise InputError("evidence.gca must be a JWT string")
        issuer = self._gca_issuer(token)
        header = gca.parse_gca_header(token, issuer.settings.algorithms)
        keys = await issuer.keys.key_set()
        if keys.get(header.kid) is None:
            keys = await issuer.keys.key_set(unknown_kid=header.kid)
        verified = gca.verify_gca_token(
            token,
            issuer=issuer.settings.issuer,
            algorithms=issuer.settings.algorithms,
            keys=keys,
            audience=self._audience,
            now=now,
            leeway=self._leeway,
        )
        binding.check_eat_nonce(
            verified.claims.get("eat_nonce"), nonce=nonce, thumbprint=thumbprint
        )
        tee = gca_tee(verified)
        identity = {
            "issuer": verified.issuer,
            "kid": verified.kid,
            "sub": verified.claims.get("sub"),
            "image_digest": tee["workload"]["image_digest"],
            "project_id": tee["platform"]["project_id"],
            "instance_id": tee["platform"]["instance_id"],
        }
        return VerifiedEvidence(tee=tee, raw_claims={"gca": verified.claims}, identity=identity)

    def _gca_issuer(self, token: str) -> TrustedIssuer:
        iss = gca.unverified_issuer(token)
        if iss is None:
            raise AttestationError("token payload is not JSON with an iss claim")
        issuer = self._issuers.get(iss)
        if issuer is None or issuer.settings.kind != "gca":
            raise AttestationError(
                "token issuer is not a configured gca issuer", code=ErrorCode.ISSUER_UNKNOWN
            )
        return issuer

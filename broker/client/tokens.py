"""Token sources: where a runner gets its attestation token.

``ConfidentialSpaceTokenSource`` speaks the Confidential Space launcher API on its Unix socket
(docs/evidence.md): ``POST /v1/token`` with ``{"audience", "nonces", "token_type"}``; the reply
body is the raw JWT (served as ``text/html`` by the launcher, so the content type is ignored).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import aiohttp

LAUNCHER_SOCKET = "/run/container_launcher/teeserver.sock"
MAX_TOKEN_BYTES = 64 * 1024
# Google's documented limits for custom tokens (docs/evidence.md).
MAX_NONCES = 6
NONCE_BYTES_RANGE = (8, 88)
MAX_AUDIENCE_BYTES = 512


class TokenSourceError(RuntimeError):
    """The attestation service did not produce a token."""


class TokenSource(Protocol):
    """Produces a CPU attestation token bound to ``audience`` and ``nonces``."""

    @property
    def evidence_kind(self) -> str:
        """The ``evidence`` member name the broker expects (``gca``)."""
        ...

    async def token(self, audience: str, nonces: Sequence[str]) -> str: ...


class GpuEvidenceSource(Protocol):
    """Produces GPU evidence whose nonce is ``gpu_nonce`` (32 bytes).

    ``gpu_nonce`` is ``SHA-256(broker nonce || runner key thumbprint)``; pass it as the SPDM nonce
    when collecting the NVML attestation report (and, for NRAS, as the request nonce in hex).
    """

    @property
    def evidence_kind(self) -> str:
        """``nvidia`` (raw evidence verified by the broker) or ``nras`` (an NRAS result)."""
        ...

    async def evidence(self, gpu_nonce: bytes) -> object: ...


class ConfidentialSpaceTokenSource:
    """Custom Confidential Space tokens from the launcher's ``teeserver`` socket."""

    evidence_kind = "gca"

    def __init__(
        self,
        socket_path: str = LAUNCHER_SOCKET,
        *,
        token_type: str = "OIDC",  # noqa: S107 - a token kind, not a secret
        timeout_seconds: float = 30.0,
    ) -> None:
        self._socket_path = socket_path
        self._token_type = token_type
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds)

    async def token(self, audience: str, nonces: Sequence[str]) -> str:
        """Ask the launcher for a token.

        Raises:
            TokenSourceError: when the request is outside Google's limits or the launcher fails.
        """
        _check_limits(audience, nonces)
        body = {"audience": audience, "nonces": list(nonces), "token_type": self._token_type}
        connector = aiohttp.UnixConnector(path=self._socket_path)
        try:
            async with (
                aiohttp.ClientSession(connector=connector, timeout=self._timeout) as session,
                session.post("http://localhost/v1/token", json=body) as response,
            ):
                payload = await response.content.read(MAX_TOKEN_BYTES + 1)
                if response.status != 200:
                    raise TokenSourceError(
                        f"launcher returned HTTP {response.status}: {payload[:200]!r}"
                    )
        except aiohttp.ClientError as exc:
            raise TokenSourceError(f"launcher socket {self._socket_path}: {exc}") from exc
        if len(payload) > MAX_TOKEN_BYTES:
            raise TokenSourceError("launcher token exceeds the size limit")
        try:
            return payload.decode("ascii").strip()
        except UnicodeDecodeError as exc:
            raise TokenSourceError("launcher token is not ASCII") from exc


def _check_limits(audience: str, nonces: Sequence[str]) -> None:
    if not audience or len(audience.encode()) > MAX_AUDIENCE_BYTES:
        raise TokenSourceError("audience must be 1..512 bytes")
    if len(nonces) > MAX_NONCES:
        raise TokenSourceError(f"at most {MAX_NONCES} nonces")
    low, high = NONCE_BYTES_RANGE
    for nonce in nonces:
        if not low <= len(nonce.encode()) <= high:
            raise TokenSourceError(f"each nonce must be {low}..{high} bytes")

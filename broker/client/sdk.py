"""The broker client used by sealed runners."""

from __future__ import annotations

import json
import ssl
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import aiohttp
from cryptography.hazmat.primitives.asymmetric import ec, rsa, x25519

from broker.client.tokens import GpuEvidenceSource, TokenSource
from broker.core.binding import binding_digest
from broker.core.encoding import b64url_decode
from broker.crypto import hpke, jwe
from broker.crypto.jwk import hybrid_jwk, public_jwk, thumbprint
from broker.crypto.wrap import release_info

MAX_RESPONSE_BYTES = 256 * 1024
KEY_TYPES = ("EC-P256", "EC-P384", "X25519", "RSA-3072", "MLKEM768-X25519")
RunnerSecret = jwe.RunnerPrivateKey | hpke.HpkePrivateKey


class BrokerClientError(RuntimeError):
    """The broker refused or failed; ``code`` is the broker's stable error code."""

    def __init__(self, status: int, code: str, message: str, details: dict[str, Any]) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.details = details


@dataclass(frozen=True)
class Challenge:
    nonce: str
    expires_at: str
    audience: str


@dataclass(frozen=True)
class ReleasedDek:
    """Released key material: a DEK, or for query keys the HPKE private key (``algorithm``)."""

    key: str
    version: int
    decision_id: str
    dek: bytes = field(repr=False)
    algorithm: str = "AES-256"
    log_index: int = -1  # the decision record's index: ask the broker's audit API for its proof


def new_runner_key(key_type: str) -> tuple[RunnerSecret, dict[str, str]]:
    """A fresh key pair for one release and its public JWK."""
    if key_type == "MLKEM768-X25519":
        private, raw = hpke.new_hybrid_key()
        return private, hybrid_jwk(raw)
    classic = new_ephemeral_key(key_type)
    return classic, public_jwk(classic.public_key())


def new_ephemeral_key(key_type: str = "EC-P256") -> jwe.RunnerPrivateKey:
    """A fresh key pair for one release, held only in this process."""
    if key_type == "EC-P256":
        return ec.generate_private_key(ec.SECP256R1())
    if key_type == "EC-P384":
        return ec.generate_private_key(ec.SECP384R1())
    if key_type == "X25519":
        return x25519.X25519PrivateKey.generate()
    if key_type == "RSA-3072":
        return rsa.generate_private_key(public_exponent=65537, key_size=3072)
    raise ValueError(f"key_type must be one of {KEY_TYPES}")


class BrokerClient:
    """Talks to one broker over HTTPS (or loopback HTTP in development)."""

    def __init__(
        self,
        base_url: str,
        *,
        ssl_context: ssl.SSLContext | None = None,
        audience: str | None = None,
        timeout_seconds: float = 30.0,
    ) -> None:
        self._base_url = base_url.rstrip("/")
        self._ssl: ssl.SSLContext | bool = ssl_context if ssl_context is not None else True
        self._audience = audience
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_seconds))

    async def __aenter__(self) -> BrokerClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        await self._session.close()

    async def challenge(self) -> Challenge:
        body = await self._post("/v1/challenge", {})
        return Challenge(
            nonce=str(body["nonce"]),
            expires_at=str(body["expires_at"]),
            audience=str(body.get("audience", "")),
        )

    async def release(
        self,
        key: str,
        token_source: TokenSource,
        *,
        version: int | None = None,
        key_type: str = "EC-P256",
        gpu_source: GpuEvidenceSource | None = None,
        wrap: str = "jwe",
    ) -> ReleasedDek:
        """Run protocol v1 end to end and return the unwrapped DEK.

        Raises:
            BrokerClientError: when the broker refuses (its code and reasons are kept).
            jwe.JweError: when the wrapped key does not decrypt or is not the one asked for.
        """
        private_key, runner_jwk = new_runner_key(key_type)
        runner_thumbprint = thumbprint(runner_jwk)
        issued = await self.challenge()
        audience = self._audience or issued.audience
        token = await token_source.token(audience, [issued.nonce, runner_thumbprint])
        evidence: dict[str, Any] = {token_source.evidence_kind: token}
        if gpu_source is not None:
            gpu_nonce = binding_digest(issued.nonce, runner_thumbprint)
            evidence[gpu_source.evidence_kind] = await gpu_source.evidence(gpu_nonce)
        request: dict[str, Any] = {
            "key": key,
            "nonce": issued.nonce,
            "evidence": evidence,
            "runner_key": runner_jwk,
        }
        if version is not None:
            request["version"] = version
        if wrap != "jwe":
            request["wrap"] = wrap
        body = await self._post("/v1/release", request)
        return unwrap_release(body, private_key, expected_key=key, expected_version=version)

    async def _post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        async with self._session.post(
            self._base_url + path, json=payload, ssl=self._ssl
        ) as response:
            raw = await response.content.read(MAX_RESPONSE_BYTES + 1)
            try:
                body = json.loads(raw) if raw else {}
            except ValueError:
                body = {}
            if response.status != 200:
                error = body.get("error", {}) if isinstance(body, dict) else {}
                details = {k: v for k, v in error.items() if k not in {"code", "message"}}
                raise BrokerClientError(
                    response.status,
                    str(error.get("code", "unknown")),
                    str(error.get("message", "")),
                    details,
                )
            if not isinstance(body, dict):
                raise BrokerClientError(response.status, "bad_response", "not a JSON object", {})
            return body


def unwrap_release(
    body: dict[str, Any],
    private_key: RunnerSecret,
    *,
    expected_key: str,
    expected_version: int | None,
) -> ReleasedDek:
    """Decrypt a release response and check that its binding matches the request.

    Raises:
        jwe.JweError: on decryption failure or a binding that names another key or release.
    """
    version = int(body["version"])
    if body.get("key") != expected_key or (
        expected_version is not None and version != expected_version
    ):
        raise jwe.JweError("the broker answered for another key or version")
    algorithm = str(body.get("algorithm", "AES-256"))
    if body.get("wrap", "jwe") == "hpke":
        info = release_info(expected_key, version, str(body["decision_id"]))
        try:
            sealed = b64url_decode(str(body["wrapped_key"]))
            material = hpke.open_(sealed, private_key, info)  # type: ignore[arg-type]
        except (ValueError, hpke.HpkeError) as exc:
            raise jwe.JweError("the HPKE-wrapped key does not open for this release") from exc
        return ReleasedDek(
            expected_key,
            version,
            str(body["decision_id"]),
            material,
            algorithm,
            int(body.get("log_index", -1)),
        )
    decrypted = jwe.decrypt(str(body["wrapped_key"]), private_key)  # type: ignore[arg-type]
    header = decrypted.protected_header
    if header.get("kid") != f"{expected_key}#{version}":
        raise jwe.JweError("wrapped key header names another key or version")
    if header.get("decision_id") != body.get("decision_id"):
        raise jwe.JweError("wrapped key header names another decision")
    return ReleasedDek(
        key=expected_key,
        version=version,
        decision_id=str(body["decision_id"]),
        dek=decrypted.plaintext,
        algorithm=algorithm,
        log_index=int(body.get("log_index", -1)),
    )

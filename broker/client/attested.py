"""Attest once, release many (issue 19): the runner side.

``BrokerClient.attest(token_source)`` makes two keys in this process (a P-256 proof-of-possession
key and an encryption key), binds both into the attestation evidence, and gets an EAR; the
returned ``Attestation`` then releases keys on it::

    async with BrokerClient(url) as client:
        attestation = await client.attest(ConfidentialSpaceTokenSource())
        weights = await attestation.release("models/llama")
        keys = await attestation.release_many(["models/llama", "queries/chat"])

``BrokerClient.release_many_for(files, token_source)`` and ``BrokerClient.release_many(keys,
token_source)`` do the same in one call: attest once, then every distinct key in one request
(``MAX_KEYS_PER_REQUEST`` a request), with full-evidence releases where the broker issues no
attestation results (``broker/client/several.py``).

Each release sends the EAR as ``Authorization: DPoP <EAR>`` with a fresh DPoP proof (RFC 9449,
signed with PyJWT) carrying the broker's latest ``DPoP-Nonce``. The private halves of both keys
stay inside the ``Attestation`` (no attribute, accessor or repr shows them). It attests again
by itself ``renew_seconds`` before the result expires, or when the broker no longer knows it;
a revoked result is not renewed behind the caller's back: the error says why it was revoked.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import ec

from broker.client.identity import Identity
from broker.client.mtls import LiveCheck
from broker.client.sdk import BrokerClientError, client_error
from broker.client.unwrap import ReleasedDek, RunnerSecret, unwrap_release
from broker.client.weights import key_of_file
from broker.crypto.weights import WeightsFormatError

DPOP_RENEW_CODES = ("attestation_unknown",)  # expired or never known: attest again
DEFAULT_RENEW_SECONDS = 30.0  # BrokerClient.attest's default
MAX_KEYS_PER_REQUEST = 16  # the broker's limit on one attested release (attested_request)

Post = Callable[[str, dict[str, Any], dict[str, str]], Awaitable[tuple[int, Any, dict[str, str]]]]
Attest = Callable[[], Awaitable["AttestedKeys"]]
Fetch = Callable[[], Awaitable[str]]


@dataclass(frozen=True)
class AttestedKeys:
    """One attestation's result and the private keys it is bound to (internal)."""

    token: str
    jti: str
    expires_at: float  # unix seconds
    pop_key: ec.EllipticCurvePrivateKey
    pop_jwk: dict[str, str]
    encryption_key: RunnerSecret
    wrap: str
    dpop_nonce: str | None

    def __repr__(self) -> str:
        return f"AttestedKeys(jti={self.jti!r}, expires_at={self.expires_at})"


def dpop_proof(keys: AttestedKeys, *, url: str, nonce: str | None, now: float | None = None) -> str:
    """A DPoP proof for ``POST url`` carrying ``keys.token`` (PyJWT signs it)."""
    claims: dict[str, Any] = {
        "jti": str(uuid.uuid4()),
        "htm": "POST",
        "htu": url,
        "iat": int(time.time() if now is None else now),
        "ath": base64.urlsafe_b64encode(hashlib.sha256(keys.token.encode("ascii")).digest())
        .rstrip(b"=")
        .decode("ascii"),
    }
    if nonce is not None:
        claims["nonce"] = nonce
    return jwt.encode(
        claims, keys.pop_key, algorithm="ES256", headers={"typ": "dpop+jwt", "jwk": keys.pop_jwk}
    )


class Attestation:
    """An attestation result this runner holds; releases any number of keys on it."""

    def __init__(
        self,
        keys: AttestedKeys,
        *,
        base_url: str,
        post: Post,
        attest: Attest,
        renew_seconds: float = DEFAULT_RENEW_SECONDS,
        bundle: Fetch | None = None,
        peer_check: LiveCheck | None = None,
    ) -> None:
        """``bundle``: fetches the SPIFFE bundle's PEM (``BrokerClient.identity_bundle``);
        ``peer_check``: ``BrokerClient.peer_attestation``."""
        self.__keys = keys
        self._url = base_url + "/v1/release"
        self._identity_url = base_url + "/v1/identity"
        self._bundle = bundle
        self._peer_check = peer_check
        self._post = post
        self._attest = attest
        self._renew_seconds = renew_seconds
        self._nonce = keys.dpop_nonce
        self._renewing = asyncio.Lock()
        self.renewals = 0

    def __repr__(self) -> str:
        return f"Attestation(jti={self.jti!r}, expires_at={self.expires_at.isoformat()})"

    @property
    def jti(self) -> str:
        return self.__keys.jti

    @property
    def token(self) -> str:
        """The EAR (useless without the PoP key, which never leaves this object)."""
        return self.__keys.token

    @property
    def expires_at(self) -> datetime:
        return datetime.fromtimestamp(self.__keys.expires_at, UTC)

    async def release(self, key: str, *, version: int | None = None) -> ReleasedDek:
        """One key.

        Raises:
            BrokerClientError: the broker's code (``policy_denied`` with its reasons,
                ``attestation_revoked`` with the revocation's reason, …).
            jwe.JweError: the wrapped key does not open for this release.
        """
        (released,) = await self._release_all([(key, version)])
        if isinstance(released, BrokerClientError):
            raise released
        return released

    async def release_many(
        self, keys: Sequence[str | tuple[str, int]]
    ) -> dict[str, ReleasedDek | BrokerClientError]:
        """Several keys in one request (one proof, one record); each key's DEK or its error,
        by name (a name asked for at two versions keeps one: use ``release_versions``). A key
        listed twice is asked for once; more than ``MAX_KEYS_PER_REQUEST`` distinct keys go in
        one request per ``MAX_KEYS_PER_REQUEST``.

        Raises:
            BrokerClientError: a request as a whole was refused (when none of its keys is
                released, the first key's error).
        """
        asks = [(k, None) if isinstance(k, str) else (k[0], k[1]) for k in keys]
        results = await self.release_versions(asks)
        return {name: result for (name, _), result in zip(asks, results, strict=True)}

    async def release_versions(
        self, asks: Sequence[tuple[str, int | None]]
    ) -> list[ReleasedDek | BrokerClientError]:
        """Each ``(key, version)`` asked (``None``: the newest enabled version), in the order
        given: every distinct one is asked for once, ``MAX_KEYS_PER_REQUEST`` a request (one
        proof and one record each), and its answer is returned for each place it was asked.

        Raises:
            BrokerClientError: a request as a whole was refused.
            jwe.JweError: a wrapped key does not open for this release.
        """
        distinct = list(dict.fromkeys(asks))
        answers: dict[tuple[str, int | None], ReleasedDek | BrokerClientError] = {}
        for start in range(0, len(distinct), MAX_KEYS_PER_REQUEST):
            batch = distinct[start : start + MAX_KEYS_PER_REQUEST]
            answers.update(zip(batch, await self._release_all(batch), strict=True))
        return [answers[ask] for ask in asks]

    async def release_for(
        self,
        source: str | Path,
        *,
        expected_key: str | None = None,
        source_options: dict[str, Any] | None = None,
    ) -> ReleasedDek:
        """The key this encrypted file was made with (``BrokerClient.release_for`` on this
        result): its header names the key and version (path, ``https://`` or ``gs://``, read
        with ``source_options``), so a file made before a rotation still opens.

        Raises:
            WeightsFormatError: not an encrypted file, or not for ``expected_key``.
            SourceError: the file cannot be read.
            BrokerClientError: as ``release``.
            jwe.JweError: as ``release``.
        """
        (result,) = await self.release_many_for(
            [source], expected_key=expected_key, source_options=source_options
        )
        if isinstance(result, BrokerClientError):
            raise result
        return result

    async def release_many_for(
        self,
        sources: Sequence[str | Path],
        *,
        expected_key: str | None = None,
        source_options: dict[str, Any] | None = None,
    ) -> list[ReleasedDek | BrokerClientError]:
        """Each file's key, in the order given: the headers are read first (all of them, before
        the broker is asked anything), then every distinct key and version goes in one
        ``release_many`` request (``MAX_KEYS_PER_REQUEST`` a request).

        Raises:
            WeightsFormatError: a file is not encrypted, or not for ``expected_key``.
            SourceError: a file cannot be read.
            BrokerClientError: the request as a whole was refused.
        """
        kids = await keys_of_files(
            sources, expected_key=expected_key, source_options=source_options
        )
        return await self.release_versions(kids)

    async def renew(self) -> None:
        """Attest again now (new keys, new result); the old result is left to expire."""
        async with self._renewing:
            self.__keys = await self._attest()
            self._nonce = self.__keys.dpop_nonce
            self.renewals += 1

    async def identity(self) -> Identity:
        """A workload certificate (SPIFFE X.509-SVID) on this result, for a key made here
        (``broker/client/identity.py``): renewed on this result at two thirds of its life.

        Raises:
            BrokerClientError: ``identity_denied``, ``attestation_revoked``, ``not_found``
                (``[identity]`` off), … (docs/api.md).
        """
        if self._bundle is None:
            raise ValueError("this attestation was made without a broker client")
        made = Identity(self._issue_identity, self._bundle, self._peer_check)
        await made.renew()
        return made

    async def _issue_identity(self, csr: str) -> dict[str, Any]:
        await self._fresh()
        status, answer, _ = await self._send({"csr": csr}, url=self._identity_url)
        if status != 201 or not isinstance(answer, dict):
            raise client_error(status, answer)
        return answer

    async def _fresh(self) -> None:
        if time.time() >= self.__keys.expires_at - self._renew_seconds:
            await self.renew()

    async def _release_all(
        self, asks: Sequence[tuple[str, int | None]]
    ) -> list[ReleasedDek | BrokerClientError]:
        await self._fresh()
        body: dict[str, Any] = {
            "keys": [name if v is None else {"key": name, "version": v} for name, v in asks]
        }
        if self.__keys.wrap != "jwe":
            body["wrap"] = self.__keys.wrap
        status, answer, keys = await self._send(body, url=self._url)
        if status != 200:
            raise client_error(status, answer)
        body_keys = answer.get("keys", []) if isinstance(answer, dict) else []
        if not isinstance(body_keys, list) or len(body_keys) != len(asks):
            raise BrokerClientError(status, "bad_response", "keys do not match the request", {})
        return [
            self._open(entry, name, version, answer, keys)
            for (name, version), entry in zip(asks, body_keys, strict=True)
        ]

    async def _send(
        self, body: dict[str, Any], *, url: str, renew_allowed: bool = True
    ) -> tuple[int, Any, AttestedKeys]:
        """POST with a proof; once more with the broker's new ``DPoP-Nonce`` when it asks
        (``use_dpop_nonce``), and after attesting again when it no longer knows the result."""
        for attempt in range(3):
            keys = self.__keys
            headers = {
                "Authorization": f"DPoP {keys.token}",
                "DPoP": dpop_proof(keys, url=url, nonce=self._nonce),
            }
            status, answer, response_headers = await self._post(url, body, headers)
            self._nonce = response_headers.get("DPoP-Nonce", self._nonce)
            code = _code(answer)
            if status == 401 and code == "use_dpop_nonce" and attempt < 2:
                continue
            if status == 401 and code in DPOP_RENEW_CODES and renew_allowed and attempt < 2:
                renew_allowed = False
                await self.renew()
                continue
            return status, answer, keys
        return status, answer, keys

    def _open(
        self,
        entry: Any,
        name: str,
        version: int | None,
        answer: dict[str, Any],
        keys: AttestedKeys,
    ) -> ReleasedDek | BrokerClientError:
        if not isinstance(entry, dict) or entry.get("key") != name:
            return BrokerClientError(200, "bad_response", f"no answer for {name}", {})
        if "error" in entry:
            return client_error(200, {"error": entry["error"]})
        return unwrap_release(
            {
                **entry,
                "decision_id": answer.get("release_id"),
                "wrap": answer.get("wrap", "jwe"),
                "log_index": answer.get("log_index", -1),
                "leaf_hash": answer.get("leaf_hash", ""),
                "log_origin": answer.get("log_origin", ""),
            },
            keys.encryption_key,
            expected_key=name,
            expected_version=version,
            policy_digest=str(entry.get("policy_digest", "")),
            expected_wrap=keys.wrap,
        )


async def keys_of_files(
    sources: Sequence[str | Path],
    *,
    expected_key: str | None = None,
    source_options: dict[str, Any] | None = None,
) -> list[tuple[str, int | None]]:
    """``(key, version)`` of each encrypted file, in order, from the headers (read in parallel,
    all of them before anything is asked of the broker).

    Raises:
        WeightsFormatError: a file is not encrypted, or not for ``expected_key``.
        SourceError: a file cannot be read.
    """
    options = source_options or {}
    kids = await asyncio.gather(
        *(asyncio.to_thread(key_of_file, source, options) for source in sources)
    )
    for source, (name, _) in zip(sources, kids, strict=True):
        if expected_key is not None and name != expected_key:
            raise WeightsFormatError(f"{source} is for key {name!r}, not {expected_key!r}")
    return list(kids)


def _code(answer: Any) -> str | None:
    if isinstance(answer, dict) and isinstance(answer.get("error"), dict):
        return str(answer["error"].get("code"))
    return None

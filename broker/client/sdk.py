"""The broker client used by sealed runners."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import ssl
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import quote

import aiohttp
import jwt
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from broker.client.broker_identity import BrokerIdentity, BrokerNotAttested, VerifiedBrokerIdentity
from broker.client.broker_pin import attest_broker
from broker.client.spiffe_peer import Peer, PeerRefused, peer_attestation_jti, peer_leaf
from broker.client.tokens import GpuEvidenceSource, TokenSource
from broker.client.unwrap import (
    ReleasedDek,
    new_runner_key,
    unwrap_release,
)
from broker.client.weights import key_of_file
from broker.core.binding import attestation_thumbprint, binding_digest
from broker.crypto.checkpoint import NoteError, NoteVerifier, parse_checkpoint
from broker.crypto.jwk import public_jwk, thumbprint
from broker.crypto.merkle import verify_inclusion
from broker.crypto.weights import WeightsFormatError

if TYPE_CHECKING:
    from broker.client.attested import Attestation

MAX_RESPONSE_BYTES = 256 * 1024


class BrokerClientError(RuntimeError):
    """The broker refused or failed; ``code`` is the broker's stable error code, or with
    ``status`` 0 one of ``TRANSPORT_CODES`` when no answer came (unreachable, TLS, time-out)."""

    def __init__(self, status: int, code: str, message: str, details: dict[str, Any]) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.details = details


T = TypeVar("T")

# ``BrokerClientError.code`` when no HTTP answer came back (``status`` 0): stable, documented.
TRANSPORT_CODES = ("broker_unreachable", "tls_error", "timeout", "connection_lost")


@contextlib.contextmanager
def reaching(url: str) -> Iterator[None]:
    """Around a request to ``url``: a failure to reach the broker is a ``BrokerClientError``
    with status 0 and one of ``TRANSPORT_CODES`` (never a raw aiohttp or ssl exception).

    Raises:
        BrokerClientError: ``tls_error`` (certificate not trusted, wrong host, handshake),
            ``timeout``, ``broker_unreachable`` (refused, no route, unknown host) or
            ``connection_lost`` (the connection broke before a whole answer); with a
            ``broker_identity``, ``broker_not_attested`` when a later connection presents
            another certificate than the attested one.
    """
    try:
        yield
    except aiohttp.ServerFingerprintMismatch as exc:
        raise BrokerClientError(
            0,
            "broker_not_attested",
            "tls: the broker's certificate is not the one its attestation was checked with",
            {"check": "tls"},
        ) from exc
    except (aiohttp.ClientSSLError, ssl.SSLError) as exc:
        raise _transport("tls_error", url, exc) from exc
    except TimeoutError as exc:
        raise _transport("timeout", url, exc) from exc
    except aiohttp.ClientConnectorError as exc:
        raise _transport("broker_unreachable", url, exc) from exc
    except aiohttp.ClientError as exc:
        raise _transport("connection_lost", url, exc) from exc


def _transport(code: str, url: str, exc: BaseException) -> BrokerClientError:
    where = url.split("?", maxsplit=1)[0]
    reason = str(exc) or type(exc).__name__
    if code == "timeout":
        reason = "no answer within the client's timeout"
    return BrokerClientError(0, code, f"{where}: {reason}", {"url": where})


@dataclass(frozen=True)
class Challenge:
    nonce: str
    expires_at: str
    audience: str


@dataclass(frozen=True)
class Proven:
    """A decision shown to be in the broker's log: a checkpoint signed by the pinned log key
    whose tree includes the decision's leaf. Keep it: anyone holding the log key can re-check
    it, and an auditor can match it against the record itself."""

    log_index: int
    leaf_hash: bytes
    checkpoint: str  # the signed note, as served
    tree_size: int
    root: bytes
    proof: tuple[bytes, ...]


class ProofError(Exception):
    """The broker's log does not show the decision (or its checkpoint is not signed by the
    pinned key). Say it to whoever audits the broker."""


class BrokerClient:
    """Talks to one broker over HTTPS (or loopback HTTP in development)."""

    def __init__(
        self,
        base_url: str,
        *,
        ssl_context: ssl.SSLContext | None = None,
        audience: str | None = None,
        timeout_seconds: float = 30.0,
        broker_identity: BrokerIdentity | None = None,
    ) -> None:
        """``broker_identity``: verify the broker's attestation (its image, its TLS key) before
        the first request, and pin its certificate for every later one (docs/runner.md)."""
        self._base_url = base_url.rstrip("/")
        self._ssl: ssl.SSLContext | bool = ssl_context if ssl_context is not None else True
        self._audience = audience
        self._timeout = timeout_seconds
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_seconds))
        self._identity = broker_identity
        self._verified: VerifiedBrokerIdentity | None = None
        self._pin: aiohttp.Fingerprint | None = None
        self._attesting = asyncio.Lock()

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

    async def verify_broker(self) -> VerifiedBrokerIdentity:
        """The broker's verified identity, checked now if not yet or no longer valid.

        Raises:
            BrokerClientError: ``broker_not_attested`` with the failed check, or a
                ``TRANSPORT_CODES`` code; ``ValueError`` without a ``broker_identity``.
        """
        if self._identity is None:
            raise ValueError("this client has no broker_identity to verify")
        async with self._attesting:
            now = datetime.now(UTC)
            if self._verified is not None and now < self._verified.expires:
                return self._verified
            url = self._base_url + "/.well-known/broker-attestation"
            try:
                with reaching(url):
                    verified, pin = await attest_broker(
                        self._base_url,
                        self._identity,
                        self._ssl,
                        now=now,
                        timeout_seconds=self._timeout,
                    )
            except BrokerNotAttested as exc:
                raise BrokerClientError(
                    0, "broker_not_attested", str(exc), {"check": exc.check}
                ) from exc
            self._verified, self._pin = verified, pin
            return verified

    async def _transport_ssl(self) -> ssl.SSLContext | bool | aiohttp.Fingerprint:
        """What a request passes as ``ssl``: the attested certificate's pin, once verified.

        Raises:
            BrokerClientError: as ``verify_broker``.
        """
        if self._identity is None:
            return self._ssl
        await self.verify_broker()
        assert self._pin is not None  # noqa: S101 - set by verify_broker
        return self._pin

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
        evidence = await self._evidence(issued, runner_thumbprint, token_source, gpu_source)
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
        return unwrap_release(
            body, private_key, expected_key=key, expected_version=version, expected_wrap=wrap
        )

    async def attest(
        self,
        token_source: TokenSource,
        *,
        gpu_source: GpuEvidenceSource | None = None,
        key_type: str = "EC-P256",
        wrap: str = "jwe",
        renew_seconds: float = 30.0,
    ) -> Attestation:
        """Attest once (``POST /v1/attest``) and get an ``Attestation`` that releases many keys,
        renewing itself before it expires. ``key_type``/``wrap``: the encryption key's kind and
        how keys are wrapped to it (``X25519``/``MLKEM768-X25519`` with ``hpke``).

        Raises:
            BrokerClientError: the broker refused (``policy_denied`` with the attestation
                policy's reasons, ``key_binding_mismatch``, …).
        """
        from broker.client.attested import Attestation, AttestedKeys  # noqa: PLC0415 - a cycle

        async def attest_once() -> AttestedKeys:
            pop_key = ec.generate_private_key(ec.SECP256R1())
            pop_jwk = public_jwk(pop_key.public_key())
            encryption_key, encryption_jwk = new_runner_key(key_type)
            binding = attestation_thumbprint(thumbprint(encryption_jwk), thumbprint(pop_jwk))
            issued = await self.challenge()
            evidence = await self._evidence(issued, binding, token_source, gpu_source)
            status, answer, headers = await self._exchange(
                self._base_url + "/v1/attest",
                {
                    "nonce": issued.nonce,
                    "evidence": evidence,
                    "runner_key": encryption_jwk,
                    "pop_key": pop_jwk,
                },
                {},
            )
            if status != 201 or not isinstance(answer, str):
                raise client_error(status, answer)
            claims = jwt.decode(answer, options={"verify_signature": False})  # our own result:
            # the broker verifies it on every use; we only read when it expires and its name
            return AttestedKeys(
                token=answer,
                jti=str(claims["jti"]),
                expires_at=float(claims["exp"]),
                pop_key=pop_key,
                pop_jwk=pop_jwk,
                encryption_key=encryption_key,
                wrap=wrap,
                dpop_nonce=headers.get("DPoP-Nonce"),
            )

        return Attestation(
            await attest_once(),
            base_url=self._base_url,
            post=self._exchange,
            attest=attest_once,
            renew_seconds=renew_seconds,
            bundle=self.identity_bundle,
            peer_check=self.peer_attestation,
        )

    async def identity_bundle(self) -> str:
        """The SPIFFE trust bundle's roots (``GET /v1/identity/bundle?format=pem``), over this
        client's connection (attested and pinned with a ``broker_identity``).

        Raises:
            BrokerClientError: ``not_found`` (``[identity]`` off), or ``TRANSPORT_CODES``.
        """
        url = self._base_url + "/v1/identity/bundle?format=pem"

        async def attempt(transport_ssl: Any) -> tuple[int, bytes]:
            async with self._session.get(url, ssl=transport_ssl) as response:
                return response.status, await response.content.read(MAX_RESPONSE_BYTES + 1)

        status, raw = await self._pinned(url, attempt)
        if status != 200:
            try:
                answer = json.loads(raw)
            except ValueError:
                answer = {}
            raise client_error(status, answer)
        return raw.decode("ascii", "replace")

    async def peer_attestation(self, peer: Peer) -> dict[str, Any]:
        """Whether a peer runner's certificate is one the broker issued on an attestation that
        still stands (``GET /v1/attestations/{jti}``, the jti from the leaf's attestation
        extension): the broker's answer ``{jti, status: "active", expires_at, identities}``.
        ``peer``: the leaf (DER or ``x509.Certificate``) or a connection's ``ssl_object``.

        1. The leaf names an attestation (its extension's ``jti``).
        2. The broker knows it (404: expired or never issued) and it is ``active``.
        3. The leaf's SHA-256 is among the certificates the broker issued on it
           (``identities[].sha256``): a leaf made with the CA key but not issued by the broker
           (a copied jti) is refused.
        4. The leaf expires no later than the attestation (``expires_at``).

        Raises:
            PeerRefused: ``peer_attestation_unknown`` (1, 2: no extension, or unknown),
                ``peer_attestation_revoked`` (2), ``peer_certificate_unknown`` (3, 4),
                ``peer_no_certificate``.
            BrokerClientError: the broker did not answer (``TRANSPORT_CODES``, ``rate_limited``),
                or answered for another jti or without a readable ``expires_at``
                (``bad_response``).
        """
        leaf = peer_leaf(peer)
        jti = peer_attestation_jti(leaf)
        url = self._base_url + "/v1/attestations/" + quote(jti, safe="")

        async def attempt(transport_ssl: Any) -> tuple[int, Any]:
            async with self._session.get(url, ssl=transport_ssl) as response:
                raw = await response.content.read(MAX_RESPONSE_BYTES + 1)
            try:
                return response.status, json.loads(raw) if raw else {}
            except ValueError:
                return response.status, {}

        status, answer = await self._pinned(url, attempt)
        if status == 404:
            raise PeerRefused("peer_attestation_unknown", f"the broker knows no attestation {jti}")
        if status != 200:
            raise client_error(status, answer)
        if not isinstance(answer, dict) or answer.get("jti") != jti:
            raise BrokerClientError(status, "bad_response", "not this attestation's status", {})
        if answer.get("status") != "active":
            raise PeerRefused("peer_attestation_revoked", f"attestation {jti} is revoked")
        _issued_on(leaf, answer)
        return answer

    async def _evidence(
        self,
        issued: Challenge,
        binding: str,
        token_source: TokenSource,
        gpu_source: GpuEvidenceSource | None,
    ) -> dict[str, Any]:
        """The token bound to the nonce and ``binding`` (a runner key's thumbprint, or both
        keys' ``attestation_thumbprint``), and GPU evidence bound to their digest."""
        audience = self._audience or issued.audience
        token = await token_source.token(audience, [issued.nonce, binding])
        evidence: dict[str, Any] = {token_source.evidence_kind: token}
        if gpu_source is not None:
            gpu_nonce = binding_digest(issued.nonce, binding)
            evidence[gpu_source.evidence_kind] = await gpu_source.evidence(gpu_nonce)
        return evidence

    async def release_for(
        self,
        source: str | Path,
        token_source: TokenSource,
        *,
        expected_key: str | None = None,
        source_options: dict[str, Any] | None = None,
        **release_options: Any,
    ) -> ReleasedDek:
        """The key for this file: reads the encrypted file's header (path, ``https://`` or
        ``gs://``; no key needed) and releases exactly the key and version it was made with,
        so that files made before a rotation keep opening. ``expected_key``: refuse a file made
        for another key (checked on the header that names the key released: one read).
        ``release_options`` go to ``release`` (``gpu_source``, ``key_type``, ``wrap``).
        One file, one full-evidence release; for several files, ``release_many_for`` (one
        attestation, one request for all their keys).

        Raises:
            WeightsFormatError: not an encrypted weights file, its key id is malformed, or it
                is not for ``expected_key``.
            SourceError: the file cannot be read.
            BrokerClientError: as ``release``.
        """
        name, version = await asyncio.to_thread(key_of_file, source, source_options or {})
        if expected_key is not None and name != expected_key:
            raise WeightsFormatError(f"{source} is for key {name!r}, not {expected_key!r}")
        return await self.release(name, token_source, version=version, **release_options)

    async def release_many_for(
        self,
        sources: Sequence[str | Path],
        token_source: TokenSource,
        *,
        expected_key: str | None = None,
        source_options: dict[str, Any] | None = None,
        attest: bool = True,
        **release_options: Any,
    ) -> list[ReleasedDek | BrokerClientError]:
        """Each file's key, in the order given, from the files' headers (as ``release_for``):
        every header is read (and checked against ``expected_key``) before the broker is asked
        anything; then the runner attests once and every distinct key and version goes in one
        request on the result (16 a request, ``Attestation.release_versions``). Where the broker
        issues no attestation results (404), or with ``attest=False``, each distinct key gets
        one full-evidence release. ``release_options``: ``gpu_source``, ``key_type``, ``wrap``.

        Returns:
            Per file, its ``ReleasedDek`` or the ``BrokerClientError`` refusing its key.

        Raises:
            WeightsFormatError: a file is not encrypted, or not for ``expected_key``.
            SourceError: a file cannot be read.
            BrokerClientError: the attestation, or a request as a whole, was refused; or no
                answer came (``TRANSPORT_CODES``).
        """
        from broker.client.attested import keys_of_files  # noqa: PLC0415 - a cycle
        from broker.client.several import release_asks  # noqa: PLC0415 - a cycle

        kids = await keys_of_files(
            sources, expected_key=expected_key, source_options=source_options
        )
        return await release_asks(
            self, kids, token_source, attest=attest, release_options=release_options
        )

    async def release_many(
        self,
        keys: Sequence[str | tuple[str, int]],
        token_source: TokenSource,
        *,
        attest: bool = True,
        **release_options: Any,
    ) -> dict[str, ReleasedDek | BrokerClientError]:
        """A runner's start-up keys (the weights key, a query key, …) in one call: attest once
        and release them all in one request on the result (``Attestation.release_many``), or
        one full-evidence release each where the broker issues no results (404) or with
        ``attest=False``. ``release_options``: ``gpu_source``, ``key_type``, ``wrap``.

        Returns:
            By key name, its ``ReleasedDek`` or the ``BrokerClientError`` refusing it.

        Raises:
            BrokerClientError: the attestation, or a request as a whole, was refused; or no
                answer came (``TRANSPORT_CODES``).
        """
        from broker.client.several import release_asks  # noqa: PLC0415 - a cycle

        asks = [(k, None) if isinstance(k, str) else (k[0], k[1]) for k in keys]
        results = await release_asks(
            self, asks, token_source, attest=attest, release_options=release_options
        )
        return {name: result for (name, _), result in zip(asks, results, strict=True)}

    async def prove(
        self, released: ReleasedDek, log_key: str, *, wait_seconds: float = 10.0
    ) -> Proven:
        """Check that the broker logged this release: its latest checkpoint is signed by
        ``log_key`` (the note verifier key an operator published, ``GET /v1/log/key``, pinned by
        you, never fetched here) and includes the release's leaf. Checkpoints are published
        every few seconds: this waits up to ``wait_seconds`` for one that covers the release.
        Each replica keeps its own log: the release names its log's origin, which must be the
        name of ``log_key`` (pin one key per replica), and the log is asked for by that origin,
        whichever replica behind a load balancer answers.

        Raises:
            ProofError: a bad signature, a checkpoint that never covers the release, or a proof
                that does not verify.
            BrokerClientError: the broker was not reached (``TRANSPORT_CODES``).
        """
        try:
            verifier = NoteVerifier.parse(log_key)
        except NoteError as exc:
            raise ProofError(f"the pinned log key is not a note verifier key: {exc}") from exc
        if released.log_index < 0 or len(released.leaf_hash) != 32:
            raise ProofError("this release carries no log index and leaf hash to prove")
        if released.log_origin and released.log_origin != verifier.name:
            raise ProofError(
                f"the release is in the log of origin {released.log_origin!r}; the key given "
                f"is {verifier.name!r}'s (pin each replica's log key)"
            )
        which = "&origin=" + quote(verifier.name, safe="") if released.log_origin else ""
        deadline = asyncio.get_running_loop().time() + wait_seconds
        while True:
            note = await self._get_text("/v1/log/checkpoint" + which.replace("&", "?", 1))
            try:
                checkpoint = parse_checkpoint(verifier.open(note), origin=verifier.name)
            except NoteError as exc:
                raise ProofError(f"the checkpoint does not verify with the log key: {exc}") from exc
            if checkpoint.size > released.log_index:
                break
            if asyncio.get_running_loop().time() >= deadline:
                raise ProofError(
                    f"no checkpoint covers log index {released.log_index} "
                    f"(latest size {checkpoint.size}) after {wait_seconds} s"
                )
            await asyncio.sleep(0.5)
        answer = json.loads(
            await self._get_text(
                f"/v1/log/proof/inclusion?index={released.log_index}&tree_size={checkpoint.size}"
                + which
            )
        )
        try:
            proof = tuple(base64.b64decode(h, validate=True) for h in answer["hashes"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ProofError("the inclusion proof is malformed") from exc
        if not verify_inclusion(
            released.leaf_hash, released.log_index, checkpoint.size, proof, checkpoint.root
        ):
            raise ProofError(
                f"the log's tree of size {checkpoint.size} does not include this release's "
                f"record at index {released.log_index}"
            )
        return Proven(
            log_index=released.log_index,
            leaf_hash=released.leaf_hash,
            checkpoint=note,
            tree_size=checkpoint.size,
            root=checkpoint.root,
            proof=proof,
        )

    async def _pinned(self, url: str, attempt: Callable[[Any], Awaitable[T]]) -> T:
        """``attempt(ssl)`` over a connection pinned to the attested certificate. A certificate
        that is no longer the pinned one (a sealed broker makes a new TLS key at each start)
        drops the verdict and attests again, once, before the same attempt: a mismatch is found
        in the handshake, before any byte of the request is sent, so repeating it is safe.

        Raises:
            BrokerClientError: as ``reaching``; ``broker_not_attested`` if the new attestation
                fails or the certificate changes again.
        """
        for last in (False, True):
            transport_ssl = await self._transport_ssl()
            try:
                with reaching(url):
                    return await attempt(transport_ssl)
            except BrokerClientError as exc:
                changed = exc.code == "broker_not_attested" and exc.details.get("check") == "tls"
                if last or self._identity is None or not changed:
                    raise
                self._verified = self._pin = None
        raise AssertionError("unreachable")  # pragma: no cover

    async def _get_text(self, path: str) -> str:
        url = self._base_url + path

        async def attempt(transport_ssl: Any) -> str:
            async with self._session.get(url, ssl=transport_ssl) as response:
                raw = await response.content.read(MAX_RESPONSE_BYTES + 1)
            if response.status != 200:
                raise ProofError(f"GET {path.split('?', maxsplit=1)[0]}: HTTP {response.status}")
            return raw.decode("utf-8", "replace")

        return await self._pinned(url, attempt)

    async def _exchange(
        self, url: str, payload: dict[str, Any], headers: dict[str, str]
    ) -> tuple[int, Any, dict[str, str]]:
        """POST; the status, the body (JSON, or text for ``application/eat+jwt``) and headers.

        Raises:
            BrokerClientError: the broker was not reached (``TRANSPORT_CODES``).
        """

        async def attempt(transport_ssl: Any) -> tuple[int, Any, dict[str, str]]:
            async with self._session.post(
                url, json=payload, headers=headers, ssl=transport_ssl
            ) as response:
                raw = await response.content.read(MAX_RESPONSE_BYTES + 1)
            answer: Any
            if response.content_type == "application/eat+jwt":
                answer = raw.decode("ascii", "replace")
            else:
                try:
                    answer = json.loads(raw) if raw else {}
                except ValueError:
                    answer = {}
            return response.status, answer, dict(response.headers)

        return await self._pinned(url, attempt)

    async def _post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        url = self._base_url + path

        async def attempt(transport_ssl: Any) -> tuple[int, Any]:
            async with self._session.post(url, json=payload, ssl=transport_ssl) as response:
                raw = await response.content.read(MAX_RESPONSE_BYTES + 1)
            try:
                return response.status, json.loads(raw) if raw else {}
            except ValueError:
                return response.status, {}

        status, body = await self._pinned(url, attempt)
        if status != 200:
            error = body.get("error", {}) if isinstance(body, dict) else {}
            details = {k: v for k, v in error.items() if k not in {"code", "message"}}
            raise BrokerClientError(
                status,
                str(error.get("code", "unknown")),
                str(error.get("message", "")),
                details,
            )
        if not isinstance(body, dict):
            raise BrokerClientError(status, "bad_response", "not a JSON object", {})
        return body


def _issued_on(leaf: x509.Certificate, answer: dict[str, Any]) -> None:
    """Steps 3 and 4 of ``peer_attestation``: ``leaf`` is listed in the attestation's
    ``identities`` and expires no later than it.

    Raises:
        PeerRefused: ``peer_certificate_unknown``.
        BrokerClientError: ``bad_response`` (no readable ``expires_at``).
    """
    digest = hashlib.sha256(leaf.public_bytes(serialization.Encoding.DER)).hexdigest()
    listed = answer.get("identities")
    if not isinstance(listed, list) or not any(
        isinstance(entry, dict) and str(entry.get("sha256", "")).lower() == digest
        for entry in listed
    ):
        raise PeerRefused(
            "peer_certificate_unknown",
            f"the broker issued no such certificate on attestation {answer['jti']}",
        )
    try:
        expires_at = datetime.fromisoformat(str(answer.get("expires_at")))
    except ValueError as exc:
        raise BrokerClientError(200, "bad_response", "no readable expires_at", {}) from exc
    if expires_at.tzinfo is None or leaf.not_valid_after_utc > expires_at:
        raise PeerRefused("peer_certificate_unknown", "the certificate outlives its attestation")


def client_error(status: int, answer: Any) -> BrokerClientError:
    error = answer.get("error", {}) if isinstance(answer, dict) else {}
    if not isinstance(error, dict):
        error = {}
    details = {k: v for k, v in error.items() if k not in {"code", "message"}}
    return BrokerClientError(
        status, str(error.get("code", "unknown")), str(error.get("message", "")), details
    )

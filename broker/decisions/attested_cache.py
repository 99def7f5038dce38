"""What one worker keeps between releases on the same attestation result (issue 31): an EAR
verified once, and its stored entry prepared once — every check of ``attested_release.py``
still made on every fetch, only the work whose answer cannot have changed is not redone.

* **Verified results** (``ResultCache``), by the SHA-256 of the presented token's exact bytes:
  what ``ear.verify_ear`` concluded (signature, ``typ``, ``kid``, issuer, audience, ``cnf``,
  lifetime). A hit is taken only for the same audience and while the mapping of result keys
  still holds, under that ``kid``, the very key object it was verified with: a rotated or
  retired result key verifies again (and fails where it must). The time checks (``exp``,
  ``nbf``, ``iat``) run again at each request's ``now`` (``ear.check_ear_times``): an expired
  result is refused though it was verified before. Only results that verified are kept; at most
  ``RESULT_ENTRIES``, the expired dropped first, then the oldest.
* **A prepared attestation** (``PreparedAttestation``), held beside its result: the stored
  entry shown to match the signed result (PoP thumbprint, digest of its claims), the encryption
  key the result names, parsed, the identity records name, and the stored claims encoded once
  (canonical JSON) for every policy input built on them. It is found again only for the very
  entry object it was made from: the memory store hands out the object it holds, the shared
  stores parse equal text into one object (``stored.ParsedEntries``); a rewritten entry is
  another object, checked anew (``attestation_store_mismatch``). The entry's status is never
  cached: each fetch reads it from the shared store, so a revocation is seen at once.

Nothing here awaits: one event loop per worker, no entry changes between a lookup and its use.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from json.encoder import encode_basestring
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ec

from broker.attestation.claims import SCHEMA, RequestFacts
from broker.attestation.ear import CLAIM, PresentedEar, check_ear_times, verify_ear
from broker.attestation.stored import AttestationEntry
from broker.audit.mask import masked
from broker.core.encoding import Encoded, canonical, canonical_members
from broker.core.errors import AttestationError, ErrorCode, UpstreamError
from broker.crypto.jwk import RunnerKey, parse_runner_key

log = logging.getLogger(__name__)

RESULT_ENTRIES = 2048  # verified results a worker keeps (each a few KiB: its claims)
STORED_PARTS = ("claims", "gpus", "tee")  # StoredInput.encoded, in this order
MASKED_SETS = 16  # masked encodings kept per attestation (a new policy's masks: a few more)
_SCHEMA = canonical(SCHEMA)


def _string(text: str) -> bytes:
    """``canonical(text)`` for a str, without building an encoder (``json.encoder``'s own)."""
    return encode_basestring(text).encode("utf-8", "backslashreplace")


@dataclass(frozen=True)
class StoredInput:
    """The stored claims as every release input on them holds them (the parts
    ``claims.build_input`` copies), each also encoded once as canonical JSON, and masked
    (``audit/mask.py``) once per set of masks that reaches into it."""

    tee: dict[str, Any]
    gpus: list[dict[str, Any]]
    claims: dict[str, dict[str, Any]]
    encoded: tuple[bytes, bytes, bytes]  # canonical claims, gpus, tee
    _masked: dict[tuple[str, tuple[str, ...], bytes], bytes] = field(
        default_factory=dict, repr=False
    )

    @classmethod
    def of(cls, stored: Mapping[str, Any]) -> StoredInput:
        tee = dict(stored.get("tee", {}))
        gpus = [dict(gpu) for gpu in stored.get("gpus", [])]
        claims = {name: dict(values) for name, values in stored.get("claims", {}).items()}
        return cls(tee, gpus, claims, (canonical(claims), canonical(gpus), canonical(tee)))

    def release_input(
        self, facts: RequestFacts, attestation: Mapping[str, str], now: datetime
    ) -> tuple[dict[str, Any], bytes]:
        """The release policy's input (what ``claims.build_input`` makes, with
        ``request.attestation``) and its canonical JSON: the stored parts' encodings spliced
        between this request's members, in the order ``canonical`` writes them (a property test
        compares the two)."""
        request = {
            "key": facts.key,
            "version": facts.version,
            "purpose": facts.purpose,
            "runner_key_thumbprint": facts.runner_key_thumbprint,
            "attestation": dict(attestation),
        }
        time = now.isoformat()
        policy_input = {
            "schema": SCHEMA,
            "request": request,
            "tee": self.tee,
            "gpus": self.gpus,
            "claims": self.claims,
            "time": time,
        }
        claims, gpus, tee = self.encoded
        encoded = b"".join(  # canonical_members' order and text, written out: ~10 µs less
            (
                b'{"claims":',
                claims,
                b',"gpus":',
                gpus,
                b',"request":',
                canonical(request),
                b',"schema":',
                _SCHEMA,
                b',"tee":',
                tee,
                b',"time":',
                _string(time),
                b"}",
            )
        )
        return policy_input, encoded

    def masked_encoding(
        self, policy_input: Mapping[str, Any], pointers: Iterable[str], key: bytes
    ) -> bytes:
        """``canonical(mask.masked(policy_input, pointers, key))`` for an input this made
        (``release_input``): a stored part no pointer reaches is its encoding; one a pointer
        reaches is masked and encoded once per set of pointers; this request's members are
        masked and encoded here. Pointers of different members never reach the same value, so
        each member is masked on its own as ``masked`` would mask it in the whole input."""
        reaching: dict[str, list[str]] = {}
        for pointer in pointers:
            if isinstance(pointer, str) and pointer.startswith("/"):
                first = pointer[1:].split("/", 1)[0].replace("~1", "/").replace("~0", "~")
                reaching.setdefault(first, []).append(pointer)
        stored = dict(zip(STORED_PARTS, (self.claims, self.gpus, self.tee), strict=True))
        members: dict[str, Any] = {}
        for name, value in policy_input.items():
            mine = reaching.get(name, [])
            if stored.get(name) is value:
                members[name] = Encoded(self._stored_masked(name, value, tuple(sorted(mine)), key))
            else:
                members[name] = masked({name: value}, mine, key)[name] if mine else value
        return b"{" + canonical_members(members) + b"}"

    def _stored_masked(self, name: str, value: Any, pointers: tuple[str, ...], key: bytes) -> bytes:
        if not pointers:
            return self.encoded[STORED_PARTS.index(name)]
        text = self._masked.get((name, pointers, key))
        if text is None:
            text = canonical(masked({name: value}, pointers, key)[name])
            if len(self._masked) < MASKED_SETS:  # masks come from configuration and policy
                self._masked[(name, pointers, key)] = text
        return text


@dataclass(frozen=True)
class PreparedAttestation:
    """A stored entry shown to be the one its result was signed for, and what each release on
    it reuses (see the module's docstring)."""

    entry: AttestationEntry  # the very object it was prepared from (compared by identity)
    encryption_key: RunnerKey
    identity: dict[str, Any]  # as records name the runner (``attestation_identity``)
    attestation: dict[str, str]  # the input's request.attestation: jti, expires_at
    stored: StoredInput


@dataclass
class HeldResult:
    """One verified result: what it verified with, what it says, what was prepared on it."""

    kid: str
    key: ec.EllipticCurvePublicKey
    audience: str
    ear: PresentedEar
    prepared: PreparedAttestation | None = None

    def prepared_for(self, entry: AttestationEntry) -> PreparedAttestation | None:
        """What was prepared from this very ``entry`` object, if anything."""
        prepared = self.prepared
        return prepared if prepared is not None and prepared.entry is entry else None


class ResultCache:
    """Results this worker verified, by the SHA-256 of the token (see the module's docstring)."""

    def __init__(self, max_entries: int = RESULT_ENTRIES) -> None:
        self._max = max(1, max_entries)
        self._held: dict[bytes, HeldResult] = {}

    def __len__(self) -> int:
        return len(self._held)

    def verify(
        self,
        token: str,
        *,
        keys: Mapping[str, ec.EllipticCurvePublicKey],
        audience: str,
        now: datetime,
    ) -> HeldResult:
        """``ear.verify_ear``, once per token while its key holds; its times at every ``now``.

        Raises:
            AttestationError: as ``verify_ear`` (``token_expired`` for a held result too).
        """
        digest = hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()
        held = self._held.get(digest)
        if held is not None and held.audience == audience and keys.get(held.kid) is held.key:
            try:
                check_ear_times(held.ear, now)
            except AttestationError:
                del self._held[digest]  # expired (or not yet valid): verified again next time
                raise
            return held
        ear = verify_ear(token, keys=keys, audience=audience, now=now)
        held = HeldResult(kid=ear.kid, key=keys[ear.kid], audience=audience, ear=ear)
        self._remember(digest, held, now)
        return held

    def _remember(self, digest: bytes, held: HeldResult, now: datetime) -> None:
        if len(self._held) >= self._max:  # the expired first; then the oldest eighth
            self._held = {d: h for d, h in self._held.items() if h.ear.expires_at > now}
            if len(self._held) >= self._max:
                for old in list(self._held)[: self._max // 8 + 1]:
                    del self._held[old]
        self._held[digest] = held


def prepare(ear: PresentedEar, entry: AttestationEntry) -> PreparedAttestation:
    """``entry``, shown to be what ``ear`` was signed for (``signed_content``), made ready for
    every release on it: its encryption key, identity and claims (encoded once).

    Raises:
        AttestationError, UpstreamError: as ``signed_content``.
    """
    encryption_key = signed_content(ear, entry)
    return PreparedAttestation(
        entry=entry,
        encryption_key=encryption_key,
        identity=attestation_identity(entry),
        attestation={"jti": entry.jti, "expires_at": entry.expires_at.isoformat()},
        stored=StoredInput.of(entry.policy_input),
    )


def signed_content(ear: PresentedEar, entry: AttestationEntry) -> RunnerKey:
    """The encryption key the signed result names, once the store's entry is shown to be the
    one the result was made with: its PoP thumbprint, and the digest of its claims (the EAR's
    ``input_digest``). The shared store is trusted for a result's status, never for what a
    release is decided on or wrapped to.

    Raises:
        AttestationError: the result lacks its broker claim (``token_claim_invalid``).
        UpstreamError: ``attestation_store_mismatch``: the entry is not what was signed.
    """
    own = ear.claims.get(CLAIM)
    if not isinstance(own, Mapping) or not isinstance(own.get("encryption_key"), Mapping):
        raise AttestationError(
            "the result lacks this broker's claim", code=ErrorCode.TOKEN_CLAIM_INVALID
        )
    check_signed_entry(entry, ear.jti, ear.pop_thumbprint, own.get("input_digest"))
    return parse_runner_key(dict(own["encryption_key"]))


def check_signed_entry(
    entry: AttestationEntry, jti: str, key_thumbprint: str, input_digest: Any
) -> None:
    """The stored entry is the one the signed result ``jti`` was made with: the key thumbprint
    it stores (a PoP key's; a KBS guest's ``tee-pubkey``) and the digest of its claims are the
    signed ones (also for ``decisions/kbs_resource.py``).

    Raises:
        UpstreamError: ``attestation_store_mismatch``.
    """
    stored = "sha256:" + hashlib.sha256(canonical(entry.policy_input)).hexdigest()
    if entry.pop_thumbprint != key_thumbprint or input_digest != stored:
        log.error("attestation %s: the stored entry does not match the signed result", jti)
        raise UpstreamError(
            "the stored attestation does not match the signed result; attest again",
            code=ErrorCode.ATTESTATION_STORE_MISMATCH,
        )


def attestation_identity(entry: AttestationEntry) -> dict[str, Any]:
    """The attestation a release came through, as records name a runner: its jti, and the
    workload, project and instance its verified claims named."""
    tee = entry.policy_input.get("tee")
    tee = tee if isinstance(tee, Mapping) else {}
    workload, platform = tee.get("workload"), tee.get("platform")
    workload = workload if isinstance(workload, Mapping) else {}
    platform = platform if isinstance(platform, Mapping) else {}
    return {
        "attestation": entry.jti,
        "issuer": tee.get("issuer"),
        "image_digest": workload.get("image_digest"),
        "project_id": platform.get("project_id"),
        "instance_id": platform.get("instance_id"),
    }

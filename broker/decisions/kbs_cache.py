"""What one worker keeps between a guest's resource requests (as ``attested_cache.py`` keeps for
releases on results): a KBS token verified once, and its stored attestation checked and encoded
once — every check still made on every request, only work whose answer cannot have changed is
not redone.

* **Verified tokens**, by the SHA-256 of the token's exact bytes: what ``verify_kbs_token``
  concluded, taken again only while the result key it verified with is still, under its ``kid``,
  the very key object of the current mapping (a rotated or retired key verifies again, and
  fails where it must); its times are checked at every request's ``now``. At most
  ``TOKEN_ENTRIES``, the expired dropped first, then the oldest eighth.
* **A checked entry** beside its token: the stored attestation shown to be the one the token was
  signed for (``check_signed_entry``) and its claims encoded once (``StoredInput``), reused only
  for the very entry object it was made from (the memory store hands out the object it holds;
  the shared stores parse equal text into one object). The entry's status is never cached.

Nothing here awaits: no entry changes between a lookup and its use.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

from cryptography.hazmat.primitives.asymmetric import ec

from broker.attestation.kbs_token import PresentedKbsToken, check_kbs_times, verify_kbs_token
from broker.attestation.stored import AttestationEntry
from broker.core.errors import AttestationError
from broker.crypto.jwk import thumbprint
from broker.decisions.attested_cache import StoredInput, check_signed_entry

TOKEN_ENTRIES = 2048


@dataclass
class HeldToken:
    token: PresentedKbsToken
    key: ec.EllipticCurvePublicKey  # the result key it verified with
    tee_thumbprint: str  # RFC 7638 of its tee-pubkey
    entry: AttestationEntry | None = None  # the entry checked against it, and its claims
    stored: StoredInput | None = None

    def stored_input(self, entry: AttestationEntry) -> StoredInput:
        """``entry``'s claims, encoded once per entry object, after it was shown to be the one
        the token was signed for.

        Raises:
            UpstreamError: ``attestation_store_mismatch`` (``check_signed_entry``).
        """
        if self.entry is entry and self.stored is not None:
            return self.stored
        token = self.token
        check_signed_entry(entry, token.jti, self.tee_thumbprint, token.input_digest)
        self.entry, self.stored = entry, StoredInput.of(entry.policy_input)
        return self.stored


class TokenCache:
    """KBS tokens this worker verified (see the module's docstring)."""

    def __init__(self, max_entries: int = TOKEN_ENTRIES) -> None:
        self._max = max(1, max_entries)
        self._held: dict[bytes, HeldToken] = {}

    def verify(
        self,
        token: str,
        *,
        keys: Mapping[str, ec.EllipticCurvePublicKey],
        audience: str,
        now: datetime,
    ) -> HeldToken:
        """``verify_kbs_token``, once per token while its key holds; its times at every ``now``.

        Raises:
            AttestationError: as ``verify_kbs_token``.
        """
        digest = hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()
        held = self._held.get(digest)
        if held is not None and keys.get(held.token.kid) is held.key:
            try:
                check_kbs_times(held.token, now)
            except AttestationError:
                del self._held[digest]
                raise
            return held
        presented = verify_kbs_token(token, keys=keys, audience=audience, now=now)
        held = HeldToken(presented, keys[presented.kid], tee_thumbprint(presented.tee_pubkey))
        if len(self._held) >= self._max:  # the expired first; then the oldest eighth
            self._held = {d: h for d, h in self._held.items() if h.token.expires_at > now}
            for old in (
                list(self._held)[: self._max // 8 + 1] if len(self._held) >= self._max else []
            ):
                del self._held[old]
        self._held[digest] = held
        return held


def tee_thumbprint(tee_pubkey: Mapping[str, object]) -> str:
    """RFC 7638 thumbprint of a ``tee-pubkey`` (its required members)."""
    names = ("crv", "kty", "x", "y") if tee_pubkey.get("kty") == "EC" else ("e", "kty", "n")
    return thumbprint({name: str(tee_pubkey.get(name)) for name in names})

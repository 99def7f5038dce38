"""An ``Identity`` outside the handshake (issue 32 review): ``keep_renewed`` rides out broker
errors and stops at once on a refusal that another attempt cannot change; a cancelled context
build leaves no key file behind; the live check keeps an ``active`` answer a few seconds, never
past the attestation; ``peer_attestation``'s binding of a leaf to its attestation.

No broker: a development CA (``tests/support/svids.py``) issues the SVIDs."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from broker.client import BrokerClientError
from broker.client.mtls import LiveCache, Peer, PeerRefused
from broker.client.sdk import _issued_on as issued_on
from tests.support.svids import LocalIssuer, SigningCa, broker_error

TRUST_DOMAIN = "runners.sdk.invalid"
FRONT = f"spiffe://{TRUST_DOMAIN}/front"
SHARD = f"spiffe://{TRUST_DOMAIN}/shard"
OTHER = f"spiffe://{TRUST_DOMAIN}/other"


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> SigningCa:
    return SigningCa.make(tmp_path_factory.mktemp("ca"), TRUST_DOMAIN)


async def test_keep_renewed_rides_out_broker_errors_and_stops_on_revocation(
    ca: SigningCa,
) -> None:
    issuer = LocalIssuer(ca, [ca], lifetime=timedelta(seconds=3), starts=timedelta(0))
    identity = issuer.identity(FRONT)
    await identity.renew()
    first = identity.svid
    issuer.failures = [
        broker_error(503, "identity_ca_unavailable"),
        broker_error(429, "rate_limited"),
        broker_error(0, "broker_unreachable"),
    ]
    task = asyncio.create_task(
        identity.keep_renewed(first_retry_seconds=0.05, max_retry_seconds=0.1)
    )
    while identity.renewals < 2 and time.time() < first.not_after:
        await asyncio.sleep(0.05)
    assert identity.svid.serial != first.serial
    assert not task.done()
    assert issuer.requests == 5  # the first, three failures, the renewal
    issuer.failures = [broker_error(403, "attestation_revoked")]
    with pytest.raises(BrokerClientError) as caught:
        await asyncio.wait_for(task, 5)
    assert caught.value.code == "attestation_revoked"
    assert time.time() < identity.svid.not_after  # at once, not once the certificate expired


async def test_keep_renewed_gives_up_only_once_the_certificate_expired(
    ca: SigningCa,
) -> None:
    issuer = LocalIssuer(ca, [ca], lifetime=timedelta(seconds=1.5), starts=timedelta(0))
    identity = issuer.identity(FRONT)
    await identity.renew()
    issuer.failures = [broker_error(503, "identity_ca_unavailable")] * 1000
    with pytest.raises(BrokerClientError) as caught:
        await asyncio.wait_for(
            identity.keep_renewed(first_retry_seconds=0.05, max_retry_seconds=0.1), 5
        )
    assert caught.value.code == "identity_ca_unavailable"
    assert time.time() >= identity.svid.not_after
    assert issuer.requests > 3


def _svid_dirs() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("svid-*")}


async def test_a_cancelled_context_build_leaves_no_key_file(ca: SigningCa) -> None:
    identity = LocalIssuer(ca, [ca]).identity(FRONT)
    await identity.renew()
    before = await asyncio.to_thread(_svid_dirs)
    for spins in range(40):
        task = asyncio.ensure_future(identity.server_context(allowed=[SHARD]))
        for _ in range(spins % 8):
            await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    deadline = time.monotonic() + 5  # the worker threads finish, and clean up, on their own
    while (left := await asyncio.to_thread(_svid_dirs) - before) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not left


async def test_a_live_answer_is_kept_briefly_and_never_past_the_attestation(
    ca: SigningCa,
) -> None:
    now = [1_000_000.0]
    expires = [now[0] + 3600]
    asked: list[Peer] = []

    async def check(peer: Peer) -> object:
        asked.append(peer)
        if expires[0] < 0:
            raise PeerRefused("peer_attestation_revoked", "test")
        return {"status": "active", "expires_at": _rfc3339(expires[0])}

    cache = LiveCache(check, seconds=5, entries=2, clock=lambda: now[0])
    a, b, c = (_leaf(ca, i) for i in (FRONT, SHARD, OTHER))
    await cache(a)
    now[0] += 4.9
    await cache(a)
    assert len(asked) == 1  # kept 5 s
    now[0] += 0.2
    await cache(a)
    assert len(asked) == 2
    expires[0] = now[0] + 1  # the attestation ends in 1 s: kept 1 s, not 5
    await cache(b)
    now[0] += 1.1
    await cache(b)
    assert len(asked) == 4
    expires[0] = now[0] + 3600
    for leaf in (a, b, c, a):  # two entries at most: c pushed a out
        await cache(leaf)
    assert len(asked) == 7
    expires[0] = -1  # refusals are never kept
    now[0] += 10
    for _ in range(2):
        with pytest.raises(PeerRefused):
            await cache(c)
    assert len(asked) == 9


def _rfc3339(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")


def _leaf(ca: SigningCa, spiffe_id: str) -> x509.Certificate:
    key = ec.generate_private_key(ec.SECP256R1()).public_key()
    now = datetime.now(UTC)
    pem = ca.leaf(spiffe_id, key, not_before=now, not_after=now + timedelta(minutes=5))
    return x509.load_pem_x509_certificates(pem)[0]


def test_a_listed_leaf_that_outlives_its_attestation_is_refused(
    ca: SigningCa,
) -> None:
    """``peer_attestation`` steps 3 and 4 on the broker's answer (no broker issues such a leaf:
    it caps a leaf's life at its attestation's, so only the answer can be made to say it)."""
    leaf = _leaf(ca, FRONT)  # five minutes
    digest = hashlib.sha256(leaf.public_bytes(serialization.Encoding.DER)).hexdigest()
    soon = _rfc3339(time.time() + 60)
    later = _rfc3339(time.time() + 3600)
    answer = {"jti": "j", "identities": [{"sha256": digest.upper()}], "expires_at": later}
    issued_on(leaf, answer)  # listed (hex in any case), and ends before the attestation
    refused = (
        answer | {"expires_at": soon},  # outlives its attestation
        answer | {"identities": [{"sha256": "00" * 32}]},  # not listed
        {"jti": "j", "expires_at": later},  # no list at all (a broker without it)
    )
    for unlisted in refused:
        with pytest.raises(PeerRefused) as caught:
            issued_on(leaf, unlisted)
        assert caught.value.code == "peer_certificate_unknown"
    with pytest.raises(BrokerClientError) as bad:
        issued_on(leaf, answer | {"expires_at": "tomorrow"})
    assert bad.value.code == "bad_response"

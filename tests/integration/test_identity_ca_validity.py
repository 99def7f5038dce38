"""Time and the workload-certificate CA on a live broker (issue 32, review M3, L4 and the
lifetime cap): a chain not valid at start-up stops the broker; one that expires while it serves
issues nothing (503 ``identity_ca_unavailable``, recorded) and ``/readyz`` warns beforehand; a
leaf never outlives ``max_lifetime_seconds``, the result or the CA, and starts 30 s before it
was asked for, never before its CA; a retired authority stays in the bundle (JWKS and PEM
alike) until it expires. The broker's clock is fixed by the test (in this process)."""

from __future__ import annotations

import base64
import functools
import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from broker.core.errors import ConfigError
from broker.dev.identity_ca import make_dev_identity_ca
from broker.signers.identity_ca import BUNDLE_REFRESH_SECONDS
from tests.integration.attested import ADMIN, Runner, attest_broker
from tests.integration.conftest import RunningBroker
from tests.integration.identity import (
    IDENTITY_TOML,
    TRUST_DOMAIN,
    ask_identity,
    bundle,
    identity_url,
    make_csr,
    with_identity,
)
from tests.support.health import readyz
from tests.support.identity_cas import IssuingCa, make_issuing_ca


class Clock:
    """The broker's clock, moved by the test."""

    def __init__(self) -> None:
        self.now = datetime.now(UTC)

    def __call__(self) -> datetime:
        return self.now


def _with_ca(ca: IssuingCa | None, workdir: Path, *, previous: IssuingCa | None = None) -> None:
    """The identity section's files: the development CA, replaced by ``ca`` if given, and a
    retired root (``identity/old-root.pem``) if ``previous`` is given."""
    with_identity(workdir)
    if ca is not None:
        ca.write(workdir / "identity")
    if previous is not None:
        old = previous.root.public_bytes(serialization.Encoding.PEM)
        (workdir / "identity" / "old-root.pem").write_bytes(old)


async def _broker(
    start_broker: Callable[..., Any],
    setup: Callable[[Path], None],
    *,
    clock: Clock | None = None,
    toml: str = IDENTITY_TOML,
) -> RunningBroker:
    return await attest_broker(start_broker, extra_toml=toml, workdir_setup=setup, clock=clock)


@pytest.mark.parametrize(
    "shift", [timedelta(days=-366), timedelta(days=2)], ids=["expired", "not-yet-valid"]
)
async def test_a_ca_not_valid_at_start_up_stops_it(
    start_broker: Callable[..., Any], shift: timedelta
) -> None:
    """Was: an expired intermediate answered every request 500, a future one 201 with
    certificates no peer accepts yet."""

    def setup(workdir: Path) -> None:
        with_identity(workdir)
        make_dev_identity_ca(workdir / "identity", TRUST_DOMAIN, now=datetime.now(UTC) + shift)

    with pytest.raises(ConfigError) as caught:
        await _broker(start_broker, setup)
    assert caught.value.key == "identity.ca_certificates"
    assert ("expired at" if shift.days < 0 else "is not valid before") in caught.value.message


async def test_a_ca_that_expires_while_serving_issues_nothing(
    start_broker: Callable[..., Any],
) -> None:
    clock = Clock()
    # valid from 10 s ago (a leaf starts no earlier) for 60 s: before the result's 120 s end
    ca = make_issuing_ca(clock.now, intermediate=(timedelta(seconds=-10), timedelta(seconds=60)))
    broker = await _broker(start_broker, functools.partial(_with_ca, ca), clock=clock)
    async with aiohttp.ClientSession() as session:
        status, health = await readyz(session, broker.url, broker.client_tls, token=ADMIN)
        assert (status, health["status"]) == (200, "degraded")
        assert any("within max_lifetime_seconds" in w for w in health["warnings"]), health
        runner = Runner(broker)
        await runner.attest(session)
        status, body, _ = await ask_identity(runner, session, make_csr()[1])
        assert status == 201, body
        leaf = x509.load_pem_x509_certificates(body["certificates"].encode())[0]
        assert leaf.not_valid_after_utc == ca.intermediate.not_valid_after_utc  # cut short
        assert leaf.not_valid_before_utc == ca.intermediate.not_valid_before_utc  # not now-30s
        clock.now = ca.intermediate.not_valid_after_utc  # expired; the result is still live
        proof = runner.proof(htu=identity_url(broker), iat=int(clock.now.timestamp()))
        status, body, _ = await ask_identity(runner, session, make_csr()[1], proof=proof)
    assert (status, body["error"]["code"]) == (503, "identity_ca_unavailable"), body
    assert "certificates" not in body
    record = [r for r in broker.records() if r["type"] == "identity"][-1]
    assert (record["result"], record["code"], record["serial"]) == (
        "error",
        "identity_ca_unavailable",
        None,
    )


async def test_a_leaf_never_outlives_max_lifetime_seconds(
    start_broker: Callable[..., Any],
) -> None:
    """A 60 s cap and a 120 s result: the leaf ends 60 s after it was asked for (the cap was
    never exercised: the result's 120 s always came first)."""
    toml = IDENTITY_TOML.replace("max_lifetime_seconds = 3600", "max_lifetime_seconds = 60")
    assert toml != IDENTITY_TOML
    broker = await _broker(start_broker, functools.partial(_with_ca, None), toml=toml)
    async with aiohttp.ClientSession() as session:
        runner = Runner(broker)
        await runner.attest(session)
        status, body, _ = await ask_identity(runner, session, make_csr()[1])
    assert status == 201, body
    leaf = x509.load_pem_x509_certificates(body["certificates"].encode())[0]
    asked = datetime.fromisoformat(
        [r for r in broker.records() if r["type"] == "identity"][-1]["time"]
    )
    ear = json.loads(base64.urlsafe_b64decode(runner.token.split(".")[1] + "=="))
    assert leaf.not_valid_after_utc == (asked + timedelta(seconds=60)).replace(microsecond=0)
    assert leaf.not_valid_after_utc < datetime.fromtimestamp(ear["exp"], UTC)
    assert body["expires_at"] == leaf.not_valid_after_utc.isoformat().replace("+00:00", "Z")


def _ders(jwks: dict[str, Any], pem: str) -> tuple[list[bytes], list[bytes]]:
    from_jwks = [base64.b64decode(key["x5c"][0]) for key in jwks["keys"]]
    from_pem = [
        c.public_bytes(serialization.Encoding.DER)
        for c in x509.load_pem_x509_certificates(pem.encode())
    ]
    return from_jwks, from_pem


async def test_a_previous_ca_is_in_the_bundle_until_it_expires(
    start_broker: Callable[..., Any],
) -> None:
    clock = Clock()
    old = make_issuing_ca(clock.now - timedelta(days=30), name="old", root_until=timedelta(days=31))
    toml = IDENTITY_TOML + 'previous_ca_certificates = ["identity/old-root.pem"]\n'
    setup = functools.partial(_with_ca, None, previous=old)
    broker = await _broker(start_broker, setup, clock=clock, toml=toml)
    current = x509.load_pem_x509_certificate(
        (broker.workdir / "identity" / "root.pem").read_bytes()
    )
    der = serialization.Encoding.DER
    expected = [current.public_bytes(der), old.root.public_bytes(der)]
    async with aiohttp.ClientSession() as session:
        jwks, pem = await bundle(broker, session), await bundle(broker, session, "pem")
        assert _ders(jwks, pem) == (expected, expected)
        assert [key["use"] for key in jwks["keys"]] == ["x509-svid", "x509-svid"]
        assert jwks["spiffe_refresh_hint"] == BUNDLE_REFRESH_SECONDS
        clock.now = old.root.not_valid_after_utc  # the retired root expired: dropped
        jwks, pem = await bundle(broker, session), await bundle(broker, session, "pem")
    assert _ders(jwks, pem) == (expected[:1], expected[:1])

"""A live broker driven through every decision and change it records (the feeds test checks
each record type's OCSF event on them; the readers test reads them; the console renders every
page over them), and a copy of its log completed by the real repair and key hand-over writers
and a record of a type this version does not know."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519

from broker.audit.identity import adopt_signing_key, claim_origin
from broker.audit.log import DecisionLog
from broker.audit.segments import repair_torn_tail
from broker.client import BrokerClientError
from broker.crypto.checkpoint import NoteSigner
from broker.keys.service import KeyService
from broker.keys.store.base import KeyVersionRecord
from tests.integration.attested import DENIED_KEY, Runner, admin_post
from tests.integration.conftest import RunningBroker
from tests.integration.identity import ask_identity, make_csr
from tests.integration.kbs import kbs_records
from tests.support.constants import KEY

EXTRA_KEY = "models/feeds-extra"
NEWER_TYPE = "from_a_newer_broker"  # a record type this version does not know


async def every_kind_of_record(broker: RunningBroker) -> str:
    """Drive a live broker (``every_record_broker``: attestation, workload certificates, KBS on)
    through every decision and change it records; the attestation's jti (it is revoked)."""
    async with broker.client() as client:
        await client.release(KEY, broker.token_source())  # release allow
        with pytest.raises(BrokerClientError):
            await client.release(DENIED_KEY, broker.token_source())  # release deny
        attestation = await client.attest(broker.token_source())  # attestation allow
        await attestation.release(KEY)  # attested_release allow
        await attestation.release_many([KEY, DENIED_KEY])  # attested_release partial
        with pytest.raises(BrokerClientError):
            await attestation.release(DENIED_KEY)  # attested_release deny (a key's)
    async with aiohttp.ClientSession() as session:  # refused before any key: no proof
        runner = Runner(broker)
        await runner.attest(session)
        status, _, _ = await runner.release(session, keys=(KEY,))
        assert status == 401
        if broker.settings.identity.enabled:  # identity allow: a workload certificate
            status, body, _ = await ask_identity(runner, session, make_csr()[1])
            assert status == 201, body
    if broker.settings.kbs.enabled:  # kbs_auth, kbs_attest, kbs_resource allow and deny
        await kbs_records(broker)
    status, body = await admin_post(
        broker, "/v1/admin/keys", {"name": EXTRA_KEY, "purpose": "model-weights"}
    )
    assert status == 201, body  # key_admin
    status, body = await admin_post(
        broker, f"/v1/admin/attestations/{attestation.jti}/revoke", {"reason": "feeds test"}
    )
    assert status == 200, body  # attestation_revoked
    broken = broker.workdir / "policies" / "broker" / "broken.rego"
    broken.write_text("package broker.release\nthis is not rego\n")
    status, body = await admin_post(broker, "/v1/admin/policy/reload")
    assert status >= 400, body  # policy_reload_failed
    broken.unlink()
    return attestation.jti


async def a_bug_after_the_first_key(broker: RunningBroker, monkeypatch: pytest.MonkeyPatch) -> None:
    """A release on a result of two keys whose second key's lookup hits a bug: the first key
    was decided (and withdrawn), the second never was; the record says so (``error``)."""
    resolve = KeyService.resolve

    async def faulty(self: KeyService, name: str, version: int | None) -> KeyVersionRecord:
        if name == DENIED_KEY:
            raise RuntimeError("injected: a bug while looking up the second key")
        return await resolve(self, name, version)

    async with aiohttp.ClientSession() as session:
        runner = Runner(broker)
        await runner.attest(session)
        with monkeypatch.context() as patched:
            patched.setattr(KeyService, "resolve", faulty)
            status, body, _ = await runner.release(
                session, proof=runner.proof(), keys=(KEY, DENIED_KEY)
            )
    assert (status, body["error"]["code"]) == (500, "internal_error")


def with_a_repair(log: Path, into: Path) -> list[dict[str, Any]]:
    """The broker's records, then a torn final line repaired by the real repair writer."""
    shutil.copyfile(log, into)
    with into.open("ab") as handle:
        handle.write(b'{"type":"release","torn')
    assert repair_torn_tail(into, now="2026-12-02T12:00:00+00:00") is not None
    return [json.loads(line) for line in into.read_bytes().splitlines()]


async def with_a_key_rotation(log: Path) -> None:
    """A checkpoint-key hand-over appended by the real writer (``audit/identity.py``)."""
    origin = "feeds.it.invalid/decisions"
    await asyncio.to_thread(claim_origin, log, origin=origin, replica="feeds")
    decisions = DecisionLog(log, replica="feeds")
    await decisions.open()
    try:
        old = NoteSigner(origin, ed25519.Ed25519PrivateKey.generate())
        new = NoteSigner(origin, ed25519.Ed25519PrivateKey.generate())
        now = "2026-12-02T12:00:01+00:00"
        assert await adopt_signing_key(decisions, old, None, now=now) is None  # known from now
        assert await adopt_signing_key(decisions, new, old, now=now) is not None  # handed over
    finally:
        await decisions.close()


async def append_record(log: Path, record: dict[str, Any]) -> None:
    """``record`` appended by the log writer (another process's, as a worker's would be)."""
    decisions = DecisionLog(log, replica="readers")
    await decisions.open()
    try:
        await decisions.append(record)
    finally:
        await decisions.close()


async def every_kind_of_log(log: Path, into: Path) -> None:
    """``log`` (a broker's, after ``every_kind_of_record``) copied to ``into`` with a torn line
    repaired, a checkpoint-key hand-over and a record of a newer broker's type: every record
    type a log can hold."""
    await asyncio.to_thread(with_a_repair, log, into)
    await with_a_key_rotation(into)
    newer = {"type": NEWER_TYPE, "time": "2026-12-02T12:00:02+00:00", "who": "broker v99"}
    await append_record(into, newer)

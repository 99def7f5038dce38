"""A live broker driven through every decision and change it records (the feeds test checks
each record type's OCSF event on them; the console renders every page over them)."""

from __future__ import annotations

import aiohttp
import pytest

from broker.client import BrokerClientError
from tests.integration.attested import DENIED_KEY, Runner, admin_post
from tests.integration.conftest import RunningBroker
from tests.integration.identity import ask_identity, make_csr
from tests.support.constants import KEY

EXTRA_KEY = "models/feeds-extra"


async def every_kind_of_record(broker: RunningBroker) -> str:
    """Drive a live broker (``identity_broker``: attestation and workload certificates on)
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

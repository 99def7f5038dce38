"""Secrets never reach the logs: DEKs, admin tokens, HSM PINs, raw tokens, private keys."""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import aiohttp
import pytest

from broker.client import BrokerClientError
from tests.integration.conftest import HSM_PIN, RunningBroker
from tests.support.constants import KEY

TOKEN = "very-secret-admin-token-31337"


async def test_nothing_secret_is_logged(
    start_broker: Any, softhsm: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    broker: RunningBroker = await start_broker(
        environ={
            "BROKER_KEYS_KEK": softhsm,
            "BROKER_ADMIN_TOKEN_SHA256": hashlib.sha256(TOKEN.encode()).hexdigest(),
        }
    )
    async with broker.client() as client:
        released = await client.release(KEY, broker.token_source())
        with pytest.raises(BrokerClientError):
            await client.release(KEY, broker.token_source(debug=True))
        tokens = [
            await broker.token_source().token("https://broker.it.invalid", ["n" * 43, "t" * 43])
        ]
    async with aiohttp.ClientSession() as session:
        for token in (TOKEN, "wrong-" + TOKEN):
            async with session.get(
                broker.url + "/v1/admin/keys",
                headers={"Authorization": f"Bearer {token}"},
                ssl=broker.client_tls,
            ) as response:
                await response.read()
    text = "\n".join(f"{r.getMessage()} {r.exc_text or ''}" for r in caplog.records)
    assert caplog.records  # the broker did log (warnings, decisions' errors)
    for secret in (released.dek.hex(), TOKEN, HSM_PIN, tokens[0].split(".")[2]):
        assert secret not in text
    log_file = broker.settings.audit.log.read_text()
    for secret in (released.dek.hex(), TOKEN, HSM_PIN):
        assert secret not in log_file

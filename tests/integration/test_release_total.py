"""The release path is total: a bug anywhere in it (injected here) still leaves one decision
record, releases nothing, and answers ``500 internal_error`` without internals."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from broker.client import BrokerClientError
from broker.decisions import release
from tests.integration.conftest import RunningBroker
from tests.support.constants import KEY


async def test_a_bug_while_deciding_is_recorded_and_nothing_is_released(
    broker: RunningBroker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken_normaliser(**_: Any) -> dict[str, Any]:
        raise RuntimeError("injected bug: secret-ish detail not-hex-Q7f3aZ")

    monkeypatch.setattr(release, "build_input", broken_normaliser)
    before = len(broker.records())
    with caplog.at_level(logging.ERROR, logger="broker.decisions.kernel"):
        async with broker.client() as client:
            with pytest.raises(BrokerClientError) as caught:
                await client.release(KEY, broker.token_source())
    error = caught.value
    assert (error.status, error.code) == (500, "internal_error")
    assert "Q7f3aZ" not in str(error.details)
    assert "wrapped_key" not in error.details
    (record,) = broker.records()[before:]
    assert (record["result"], record["code"]) == ("error", "internal_error")
    assert record["index"] == error.details["log_index"]  # the client can ask for its proof
    assert record["identity"]["image_digest"]  # what was verified before the bug is kept
    assert "injected bug" in caplog.text  # the traceback is the operator's, in the server log


async def test_a_bug_building_the_record_still_logs_one_and_releases_nothing(
    broker: RunningBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_record(*_: Any, **__: Any) -> dict[str, Any]:
        raise RuntimeError("injected bug in the record builder")

    monkeypatch.setattr(release.ReleasePlan, "body", broken_record)
    before = len(broker.records())
    async with broker.client() as client:
        with pytest.raises(BrokerClientError) as caught:
            await client.release(KEY, broker.token_source())  # would have been allowed
    assert (caught.value.status, caught.value.code) == (500, "internal_error")
    assert "wrapped_key" not in caught.value.details
    (record,) = broker.records()[before:]
    assert record["type"] == "release"
    assert (record["result"], record["code"]) == ("error", "internal_error")

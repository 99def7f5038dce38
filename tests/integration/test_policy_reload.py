"""Hot reload that never lets a bad policy go live: admin endpoint, polling; checks, tests and
smoke evaluation before the swap; a policy_change record for every change that goes live."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import io
import json
from typing import Any

import aiohttp
import pytest

from broker.cli import main as cli
from broker.client import BrokerClientError
from broker.core.encoding import canonical
from tests.integration.conftest import RunningBroker
from tests.support.constants import ALLOWED, KEY

TOKEN = "policy-admin-token-91d3"
KEY_ADMIN_ONLY = "key-admin-token-55aa"


def admin_env() -> dict[str, str]:
    return {"BROKER_ADMIN_TOKEN_SHA256": hashlib.sha256(TOKEN.encode()).hexdigest()}


async def reload(broker: RunningBroker, token: str = TOKEN) -> tuple[int, dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            broker.url + "/v1/admin/policy/reload",
            headers={"Authorization": f"Bearer {token}"},
            ssl=broker.client_tls,
        ) as response,
    ):
        return response.status, await response.json()


async def readyz(broker: RunningBroker) -> dict[str, Any]:
    """``/readyz`` with its details (shown to an admin token only)."""
    async with (
        aiohttp.ClientSession() as session,
        session.get(
            broker.url + "/readyz",
            ssl=broker.client_tls,
            headers={"Authorization": f"Bearer {TOKEN}"},
        ) as response,
    ):
        return dict(await response.json())


def edit_data(broker: RunningBroker, **changes: Any) -> None:
    path = broker.workdir / "policies" / "broker" / "data.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


async def released(broker: RunningBroker) -> bool:
    async with broker.client() as client:
        try:
            await client.release(KEY, broker.token_source())
        except BrokerClientError as exc:
            assert exc.code == "policy_denied", exc  # noqa: PT017 - a denial, nothing else
            return False
    return True


async def test_reload_swaps_a_good_policy_and_records_the_change(start_broker: Any) -> None:
    broker: RunningBroker = await start_broker(environ=admin_env())
    assert await released(broker)
    before = (await readyz(broker))["checks"]["policy"]
    await asyncio.to_thread(edit_data, broker, images={KEY: ["sha256:" + "ee" * 32]})
    status, body = await reload(broker)
    assert status == 200, body
    assert body["changed"] is True
    assert body["previous_digest"] == before
    assert not await released(broker)  # the new policy decides at once
    change = [r for r in broker.records() if r["type"] == "policy_change"]
    assert [c["trigger"] for c in change] == ["startup", "admin"]  # every policy that went live
    assert (change[0]["old_digest"], change[0]["new_digest"]) == (None, before)
    assert (change[1]["old_digest"], change[1]["new_digest"]) == (before, body["active_digest"])
    assert change[1]["who"].startswith("token:")
    assert change[0]["who"] == "broker"
    assert change[1]["source_digest"].startswith("sha256:")
    denial = [r for r in broker.records() if r["type"] == "release"][-1]
    assert denial["policy_digest"] == body["active_digest"]
    assert denial["input"]["tee"]["workload"]["image_digest"] == ALLOWED  # replayable input


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        ({"release.rego": "package broker.release\nallow if {\n"}, "rego_parse_error"),
        (
            {"extra.rego": "package broker.release\nimport rego.v1\nallow if input.x\n"},
            "package broker.release is not allowed",
        ),
        (
            {
                "release_test.rego": "package broker.release_test\nimport rego.v1\n"
                "test_fails if false\n"
            },
            "opa test failed",
        ),
        ({"data.json": "{not json"}, "broker/data.json is not JSON"),
    ],
)
async def test_a_broken_policy_is_refused_and_the_old_one_keeps_serving(
    start_broker: Any, broken: dict[str, str], message: str
) -> None:
    broker: RunningBroker = await start_broker(environ=admin_env())
    before = (await readyz(broker))["checks"]["policy"]

    def write() -> None:
        for name, text in broken.items():
            (broker.workdir / "policies" / "broker" / name).write_text(text)

    await asyncio.to_thread(write)
    status, body = await reload(broker)
    assert (status, body["error"]["code"]) == (409, "policy_invalid")
    assert message in body["error"]["problem"]
    assert body["error"]["active_digest"] == before
    assert await released(broker)  # the last good policy still decides
    ready = await readyz(broker)
    assert ready["checks"]["policy"] == before
    assert "failed" in ready["checks"]["policy_last_reload"]
    assert [r["trigger"] for r in broker.records() if r["type"] == "policy_change"] == ["startup"]
    (failure,) = [r for r in broker.records() if r["type"] == "policy_reload_failed"]
    assert failure["who"].startswith("token:")
    assert failure["active_digest"] == before
    assert message in failure["problem"]
    async with (
        aiohttp.ClientSession() as session,
        session.get(broker.url + "/metrics", ssl=broker.client_tls) as response,
    ):
        assert 'broker_policy_reloads_total{result="failed"} 1.0' in await response.text()


async def test_reload_needs_the_policy_admin_role(start_broker: Any) -> None:
    config = (
        f'\n[[admin.tokens]]\nsha256 = "{hashlib.sha256(KEY_ADMIN_ONLY.encode()).hexdigest()}"\n'
        'roles = ["key-admin"]\n'
    )
    broker: RunningBroker = await start_broker(environ=admin_env(), extra_toml=config)
    status, body = await reload(broker, token=KEY_ADMIN_ONLY)
    assert (status, body["error"]["code"]) == (401, "unauthorized")
    status, _ = await reload(broker)
    assert status == 200


async def test_polling_picks_up_a_changed_policy(start_broker: Any) -> None:
    broker: RunningBroker = await start_broker(
        environ={**admin_env(), "BROKER_POLICY_RELOAD_SECONDS": "1"}
    )
    assert await released(broker)
    await asyncio.to_thread(edit_data, broker, images={KEY: []})
    for _ in range(180):
        await asyncio.sleep(0.1)
        if not await released(broker):
            break
    else:
        pytest.fail("the changed policy never went live")
    change = [r for r in broker.records() if r["type"] == "policy_change"]
    assert [c["trigger"] for c in change] == ["startup", "poll"]


async def test_configured_mask_hides_input_values_in_records(start_broker: Any) -> None:
    broker: RunningBroker = await start_broker(
        environ={"BROKER_AUDIT_MASK": "/tee/workload/image_digest"}
    )
    assert await released(broker)
    record = [r for r in broker.records() if r["type"] == "release"][-1]
    key = (broker.settings.audit.log.parent / "mask.key").read_bytes()  # created at start-up
    expected = "hmac-sha256:" + hmac.new(key, canonical(ALLOWED), hashlib.sha256).hexdigest()
    assert record["input"]["tee"]["workload"]["image_digest"] == expected
    assert ALLOWED not in json.dumps(record["input"]["tee"])
    # an auditor who holds the key checks a guess with the CLI
    config = str(broker.workdir / "broker.toml")

    def guess() -> str:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli.main(["audit", "mask", json.dumps(ALLOWED), "--config", config]) == 0
        return out.getvalue().strip()

    assert await asyncio.to_thread(guess) == expected
    # A pointer masks that place only: the raw claims keep their own copy unless masked too.
    assert record["input"]["claims"]["gca"]["submods"]["container"]["image_digest"] == ALLOWED

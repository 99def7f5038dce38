"""One validation path for key administration: every invalid case through the admin API and the
CLI gets the same code and message, and every change says who made it.

The CLI used to create a query key without ``[keys] signing_key`` (which the API refused); every
process sharing the store then failed ``/readyz``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import json
from typing import Any

import aiohttp
import pytest

from broker.cli import main as cli
from broker.keys.admin import cli_actor
from tests.integration.conftest import RunningBroker
from tests.support.constants import KEY

TOKEN = "key-admin-paths-token-0b7e"
# (case, API path, API body, CLI arguments after "keys"), every one invalid
CASES: list[tuple[str, str, dict[str, Any], list[str]]] = [
    ("create-bad-name", "/v1/admin/keys", {"name": "Bad Name", "purpose": "generic"},
     ["create", "Bad Name", "--purpose", "generic"]),
    ("create-long-name", "/v1/admin/keys", {"name": "m/" + "a" * 200, "purpose": "generic"},
     ["create", "m/" + "a" * 200, "--purpose", "generic"]),
    ("create-bad-purpose", "/v1/admin/keys", {"name": "models/x", "purpose": "weights"},
     ["create", "models/x", "--purpose", "weights"]),
    ("create-bad-algorithm", "/v1/admin/keys",
     {"name": "models/x", "purpose": "generic", "algorithm": "AES-128"},
     ["create", "models/x", "--purpose", "generic", "--algorithm", "AES-128"]),
    ("create-algorithm-of-another-purpose", "/v1/admin/keys",
     {"name": "models/x", "purpose": "generic", "algorithm": "HPKE-X25519"},
     ["create", "models/x", "--purpose", "generic", "--algorithm", "HPKE-X25519"]),
    ("create-query-key-without-signing-key", "/v1/admin/keys",
     {"name": "queries/x", "purpose": "query"},
     ["create", "queries/x", "--purpose", "query"]),
    ("create-existing", "/v1/admin/keys", {"name": KEY, "purpose": "generic"},
     ["create", KEY, "--purpose", "generic"]),
    ("rotate-unknown", "/v1/admin/keys/rotate", {"name": "models/nope"},
     ["rotate", "models/nope"]),
    ("rotate-bad-name", "/v1/admin/keys/rotate", {"name": "../etc"}, ["rotate", "../etc"]),
    *[
        (f"{action}-{label}", f"/v1/admin/keys/{action}", {"name": name, "version": version},
         [action, name, "--version", str(version), *(["--yes"] if action == "destroy" else [])])
        for action in ("disable", "enable", "destroy")
        for label, name, version in (
            ("version-zero", KEY, 0), ("missing-version", KEY, 99), ("unknown-key", "models/n", 1)
        )
    ],
]  # fmt: skip


@pytest.fixture
async def admin_broker(start_broker: Any) -> RunningBroker:
    return await start_broker(  # type: ignore[no-any-return]
        environ={"BROKER_ADMIN_TOKEN_SHA256": hashlib.sha256(TOKEN.encode()).hexdigest()}
    )


async def api(broker: RunningBroker, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            broker.url + path,
            json=body,
            headers={"Authorization": f"Bearer {TOKEN}"},
            ssl=broker.client_tls,
        ) as response,
    ):
        return response.status, await response.json()


async def run_cli(broker: RunningBroker, arguments: list[str]) -> tuple[int, str, str]:
    config = str(broker.workdir / "broker.toml")

    def run() -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(["keys", *arguments[:1], "--config", config, *arguments[1:]])
        return code, out.getvalue(), err.getvalue()

    return await asyncio.to_thread(run)


async def test_every_invalid_admin_operation_is_refused_alike_by_api_and_cli(
    admin_broker: RunningBroker,
) -> None:
    operations = {path for _, path, _, _ in CASES}
    assert operations == {
        "/v1/admin/keys",
        "/v1/admin/keys/rotate",
        "/v1/admin/keys/disable",
        "/v1/admin/keys/enable",
        "/v1/admin/keys/destroy",
    }  # fmt: skip  (every mutating admin route)
    before = await run_cli(admin_broker, ["list"])
    for case, path, body, arguments in CASES:
        status, answer = await api(admin_broker, path, body)
        assert 400 <= status < 500, (case, status, answer)
        code, message = answer["error"]["code"], answer["error"]["message"]
        exit_code, _, stderr = await run_cli(admin_broker, arguments)
        assert exit_code == 1, (case, stderr)
        assert stderr.strip() == f"error: {code}: {message}", case
    assert await run_cli(admin_broker, ["list"]) == before  # nothing changed anywhere


async def test_every_key_change_says_who_made_it(admin_broker: RunningBroker) -> None:
    status, _ = await api(
        admin_broker, "/v1/admin/keys", {"name": "models/api", "purpose": "generic"}
    )
    assert status == 201
    exit_code, _, stderr = await run_cli(
        admin_broker, ["create", "models/cli", "--purpose", "generic"]
    )
    assert exit_code == 0, stderr
    assert (await run_cli(admin_broker, ["disable", "models/cli", "--version", "1"]))[0] == 0
    records = [
        json.loads(line)
        for line in admin_broker.settings.audit.log.read_text().splitlines()
        if '"key_admin"' in line
    ]
    who = {(r["action"], r["key"]): r["who"] for r in records if r.get("key") != KEY}
    token_id = "token:" + hashlib.sha256(TOKEN.encode()).hexdigest()[:12]
    assert who == {
        ("create", "models/api"): token_id,
        ("create", "models/cli"): cli_actor(),
        ("disable", "models/cli"): cli_actor(),
    }
    assert "@" in cli_actor()

"""The hostile-input suite against one broker (GPU, admin and query surfaces on), then the
decision-log audit: every release whose body parsed has exactly one record, and
``broker audit verify`` passes on the log.

Each case (tests/integration/hostile/) asserts the exact status and error code; all
mismatches are reported together, so one run shows the whole picture.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.integration.conftest import RunningBroker, write_statement_key
from tests.integration.hostile import ADMIN_TOKEN, NO_BODY, Case, Ctx, all_cases
from tests.integration.test_gpu_release import start_gpu_broker, world  # noqa: F401
from tests.support.constants import QUERY_KEY
from tests.vectors.gpu import RimAuthority, SimulatedGpu, SimulatedNras


@pytest.fixture(params=["process", "workers"])
def deployment(request: pytest.FixtureRequest) -> str:
    """As deployed: every broker of this module in one process, and behind
    ``broker serve --workers 2`` (conftest ``start_broker``)."""
    return str(request.param)


MIN_CASES = 300
ROOT = Path(__file__).resolve().parents[2]


async def send(
    session: aiohttp.ClientSession, broker: RunningBroker, case: Case, ctx: Ctx
) -> tuple[int, dict[str, Any] | None, str]:
    body = case.body
    if callable(body):
        body = await body(ctx)
    headers = dict(case.headers)
    if case.admin:
        headers["Authorization"] = f"Bearer {ADMIN_TOKEN}"
    data: bytes | None = None
    if isinstance(body, bytes):
        data = body
    elif body is not NO_BODY:
        data = json.dumps(body).encode()
    if data is not None:
        headers.setdefault("Content-Type", "application/json")
    async with session.request(
        case.method, broker.url + case.path, data=data, headers=headers, ssl=broker.client_tls
    ) as response:
        text = await response.text(errors="replace")
        try:
            parsed = json.loads(text) if "json" in response.content_type else None
        except ValueError:
            parsed = None
        return response.status, parsed, text


async def test_hostile_inputs_get_exact_answers_and_every_decision_is_logged(
    start_broker: Any,
    world: tuple[SimulatedGpu, RimAuthority, SimulatedNras],  # noqa: F811
    tmp_path: Path,
) -> None:
    signing_key = write_statement_key(tmp_path / "statement.key")
    broker = await start_gpu_broker(
        start_broker,
        world,
        environ={
            "BROKER_ADMIN_TOKEN_SHA256": hashlib.sha256(ADMIN_TOKEN.encode()).hexdigest(),
            "BROKER_KEYS_SIGNING_KEY": str(signing_key),
        },
    )
    cases = all_cases(broker.settings.server.max_body_bytes)
    names = Counter(case.name for case in cases)
    assert not [n for n, count in names.items() if count > 1], "case names must be unique"
    assert len(cases) >= MIN_CASES

    failures: list[str] = []
    logged_request_ids: dict[str, str] = {}
    connector = aiohttp.TCPConnector(limit=8)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def challenge() -> str:
            async with session.post(
                broker.url + "/v1/challenge", json={}, ssl=broker.client_tls
            ) as reply:
                return str((await reply.json())["nonce"])

        status, _, _ = await send(
            session,
            broker,
            Case(
                "setup",
                "POST",
                "/v1/admin/keys",
                201,
                None,
                {"name": QUERY_KEY, "purpose": "query"},
                admin=True,
            ),
            Ctx(
                broker.issuer,
                broker.settings.server.audience,
                world[0],
                world[2],
                world[0],
                challenge,
            ),
        )
        assert status == 201
        ctx = Ctx(
            issuer=broker.issuer,
            audience=broker.settings.server.audience,
            gpu=world[0],
            nras=world[2],
            stranger_gpu=SimulatedGpu(world[0].now),
            challenge=challenge,
        )
        for case in cases:
            try:
                status, body, text = await send(session, broker, case, ctx)
            except aiohttp.ServerDisconnectedError:
                failures.append(f"{case.name}: the server closed the connection")
                continue
            got_code = (body or {}).get("error", {}).get("code") if isinstance(body, dict) else None
            if status >= 500:
                failures.append(f"{case.name}: 5xx {status} {text[:200]}")
            if (status, got_code) != (case.status, case.code):
                failures.append(
                    f"{case.name}: expected {case.status} {case.code}, got {status} {got_code}"
                    f" ({text[:160]})"
                )
            if "Traceback" in text or ("wrapped_key" in text and status != 200):
                failures.append(f"{case.name}: leaked a traceback or key material")
            if status >= 400 and not (
                isinstance(body, dict) and body.get("error", {}).get("request_id")
            ):
                failures.append(
                    f"{case.name}: error without the documented JSON shape: {text[:120]}"
                )
            if case.logged:
                request_id = (
                    body["error"]["request_id"]
                    if status >= 400 and isinstance(body, dict)
                    else None
                )
                if status == 200 and isinstance(body, dict):
                    request_id = f"decision:{body['decision_id']}"
                if request_id:
                    logged_request_ids[request_id] = case.name

    assert not failures, f"{len(failures)} of {len(cases)} cases failed:\n" + "\n".join(failures)

    # The audit: one record per release that got past body parsing, and no other.
    records = [r for r in broker.records() if r.get("type") == "release"]
    by_request = Counter(r["request_id"] for r in records)
    by_decision = {f"decision:{r['decision_id']}" for r in records}
    expected = [c for c in cases if c.logged]
    assert len(records) == len(expected), (len(records), len(expected))
    for request_id, name in logged_request_ids.items():
        if request_id.startswith("decision:"):
            assert request_id in by_decision, name
        else:
            assert by_request[request_id] == 1, name
    assert all(count == 1 for count in by_request.values())
    verified = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "broker.cli",
        "audit",
        "verify",
        str(broker.settings.audit.log),
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await verified.communicate()
    assert verified.returncode == 0, out
    assert json.loads(out)["ok"] is True
    print(f"hostile suite: {len(cases)} cases, {len(records)} decision records, audit verify ok")


@pytest.mark.parametrize("case_count", [MIN_CASES])
def test_hostile_suite_is_large_enough(case_count: int) -> None:
    assert len(all_cases(256 * 1024)) >= case_count

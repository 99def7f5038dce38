"""``broker policy replay`` re-decides workload-certificate records (issue 32: the identity
policy "tested and replayable like the others").

A live broker issues certificates (and refuses some), then its own log is replayed against
candidate identity policies: the policy it runs (nothing changes), one that maps the image to
another SPIFFE path (each certificate's ID changes), one that maps it to none (each allow
becomes a deny); and a record the broker denied because the policy's path is no SPIFFE ID path
replays as the same deny, and as an allow once the path is fixed.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from tests.integration.attested import Runner, admin_post
from tests.integration.conftest import RunningBroker
from tests.integration.identity import (
    SPIFFE_ID,
    SPIFFE_PATH,
    TRUST_DOMAIN,
    ask_identity,
    identity_broker,
    make_csr,
)
from tests.support.cli import run
from tests.support.constants import ALLOWED

MOVED_ID = f"spiffe://{TRUST_DOMAIN}/shards/mistral"


def _identity_records(broker: RunningBroker) -> list[dict[str, Any]]:
    return [r for r in broker.records() if r["type"] == "identity"]


def _candidate(broker: RunningBroker, target: Path, identities: dict[str, str]) -> Path:
    """A copy of the broker's policy whose identity data is ``identities``."""
    shutil.copytree(broker.workdir / "policies", target)
    data_file = target / "broker" / "data.json"
    data = json.loads(data_file.read_text())
    data["identities"] = identities
    data_file.write_text(json.dumps(data))
    return target


def _replay(log: Path, policies: Path) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The changed decisions (by decision id) and the summary."""
    ran = run("policy", "replay", "--log", str(log), "--policy", str(policies))
    assert ran.returncode == 0, ran.stderr
    lines = [json.loads(line) for line in ran.stdout.splitlines()]
    return lines[:-1], lines[-1]["summary"]


def _summary(**counts: int) -> dict[str, int]:
    names = ("decisions", "unchanged", "allow_to_deny", "deny_to_allow", "spiffe_id_changed",
             "reasons_changed", "skipped")  # fmt: skip
    return {name: counts.get(name, 0) for name in names}


async def _issue(broker: RunningBroker) -> None:
    """Two certificates on two attestations, a CSR naming another ID (the policy gave one: a
    refusal that is not the policy's) and a CSR for the PoP key (refused before the policy)."""
    async with aiohttp.ClientSession() as session:
        for _ in range(2):
            runner = Runner(broker)
            await runner.attest(session)
            status, body, _ = await ask_identity(runner, session, make_csr()[1])
            assert (status, body.get("spiffe_id")) == (201, SPIFFE_ID), body
        _, other = make_csr(uris=(f"spiffe://{TRUST_DOMAIN}/admin",))
        status, body, _ = await ask_identity(runner, session, other)
        assert (status, body["error"]["code"]) == (403, "identity_not_allowed")
        status, body, _ = await ask_identity(runner, session, make_csr(runner.pop)[1])
        assert (status, body["error"]["code"]) == (400, "csr_key_is_pop_key")


async def test_replay_reports_a_moved_or_withdrawn_identity_and_nothing_else(
    start_broker: Callable[..., Any], tmp_path: Path
) -> None:
    broker = await identity_broker(start_broker)
    await _issue(broker)
    records = _identity_records(broker)
    assert [(r["result"], r["code"], r["spiffe_id"]) for r in records] == [
        ("allow", None, SPIFFE_ID),
        ("allow", None, SPIFFE_ID),
        ("deny", "identity_not_allowed", SPIFFE_ID),
        ("deny", "csr_key_is_pop_key", None),
    ]
    decided = [r["decision_id"] for r in records[:3]]  # the pop-key CSR never reached the policy
    log = broker.settings.audit.log
    # the policy it runs: 2 attestations and 3 identities decided the same, the 4th skipped
    changes, summary = await asyncio.to_thread(_replay, log, broker.workdir / "policies")
    assert (changes, summary) == ([], _summary(decisions=5, unchanged=5, skipped=1))

    moved = _candidate(broker, tmp_path / "moved", {ALLOWED: "shards/mistral"})
    changes, summary = await asyncio.to_thread(_replay, log, moved)
    assert summary == _summary(decisions=5, unchanged=2, spiffe_id_changed=3, skipped=1)
    assert [c["decision_id"] for c in changes] == decided
    for change in changes:
        assert (change["type"], change["key"]) == ("identity", None)
        assert change["old"] == {"allow": True, "reasons": [], "spiffe_id": SPIFFE_ID}
        assert change["new"] == {"allow": True, "reasons": [], "spiffe_id": MOVED_ID}

    withdrawn = _candidate(broker, tmp_path / "withdrawn", {})
    changes, summary = await asyncio.to_thread(_replay, log, withdrawn)
    assert summary == _summary(decisions=5, unchanged=2, allow_to_deny=3, skipped=1)
    assert [c["decision_id"] for c in changes] == decided
    reason = f"image {ALLOWED} has no workload identity"
    for change in changes:
        assert change["new"] == {"allow": False, "reasons": [reason], "spiffe_id": None}


async def test_a_path_that_is_no_spiffe_id_replays_as_the_same_deny(
    start_broker: Callable[..., Any], tmp_path: Path
) -> None:
    """The record keeps the broker's reason (not the policy's empty one), so the policy that
    denied it replays unchanged; a candidate with a valid path would give the certificate."""
    broker = await identity_broker(start_broker)
    data_file = broker.workdir / "policies" / "broker" / "data.json"
    data = json.loads(data_file.read_text())
    data["identities"] = {ALLOWED: "shards/../llama"}
    data_file.write_text(json.dumps(data))
    status, body = await admin_post(broker, "/v1/admin/policy/reload")
    assert status == 200, body
    async with aiohttp.ClientSession() as session:
        runner = Runner(broker)
        await runner.attest(session)
        status, body, _ = await ask_identity(runner, session, make_csr()[1])
    assert (status, body["error"]["code"]) == (403, "identity_denied")
    reason = "the identity policy's spiffe_path: the SPIFFE ID path segment '..' is not allowed"
    (record,) = _identity_records(broker)
    assert (record["reasons"], record["spiffe_id"]) == ([reason], None)
    log = broker.settings.audit.log
    changes, summary = await asyncio.to_thread(_replay, log, broker.workdir / "policies")
    assert (changes, summary) == ([], _summary(decisions=2, unchanged=2))

    fixed = _candidate(broker, tmp_path / "fixed", {ALLOWED: SPIFFE_PATH})
    (change,), summary = await asyncio.to_thread(_replay, log, fixed)
    assert summary == _summary(decisions=2, unchanged=1, deny_to_allow=1)
    assert change["decision_id"] == record["decision_id"]
    assert change["old"] == {"allow": False, "reasons": [reason], "spiffe_id": None}
    assert change["new"] == {"allow": True, "reasons": [], "spiffe_id": SPIFFE_ID}

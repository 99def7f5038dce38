r"""Characterisation: the decision records the broker writes, byte for byte (issue 30).

For each plan (a full-evidence ``release``, an ``attestation``, an ``attested_release`` on an
attestation result) and each outcome one can reach cheaply — allow (and partial), a refusal of
each kind (the policy, the request's shape, the nonce, the evidence or result, the key), an
upstream failure (``error``), a bug while deciding and a bug while building the record
(``internal_error``, with a wrapped key withdrawn), a client that hangs up mid-decision — one
broker with every input fixed (``decision_flows.fixed_broker``) serves the request over HTTP,
and the record it appends is compared with ``tests/vectors/decision_records/<plan>.<outcome>.json``.
The files were generated from the code as it was before the decision kernel
(``broker/decisions/``) replaced the three hand-written copies of the skeleton: old logs must
still verify, query and replay, so the format may not move.

Normalised explicitly before comparing (``normalised``), and nothing else: the chain members
``index``, ``seq``, ``prev`` and ``hash`` (``verify`` checks them); ``request_id`` (the
server's); the UUIDs the broker draws (the decision id — an attestation's ``jti`` too — and, in a
release on a result, the result's ``jti``), checked to be UUIDs and replaced by name; the result's
``log_index`` (checked to be that attestation record's index); the digest of the policy in force
(it follows the shipped policy files, not the record format); an ``input_digest`` over an input
that holds such a UUID (a release on a result names the result). Every ``input_digest`` is first
checked to be the SHA-256 of its input's canonical JSON with the masked member (``[audit]
mask``, checked to be the HMAC of the known value) put back. The stored line must be canonical
JSON, and the normalised record is written back in the same encoding.

After a deliberate change of the record format (say why in the commit), regenerate the files::

    BROKER_REGENERATE_DECISION_RECORDS=1 .venv/bin/pytest -q \
        tests/integration/test_decision_records.py

That run writes every file and skips; ``git diff tests/vectors/decision_records/`` shows the change.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import os
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography.hazmat.primitives.asymmetric import x25519

from broker.audit.mask import mask_value
from broker.core.encoding import canonical
from broker.crypto.jwk import public_jwk
from broker.dev.issuer import Workload
from tests.integration.attested import DENIED_KEY
from tests.integration.conftest import RunningBroker
from tests.integration.decision_flows import (
    MASK_KEY,
    PLANS,
    Gate,
    attest_body,
    attestation_store_down,
    fixed_broker,
    fixed_proof,
    fixed_runner,
    hang_up_while_deciding,
    kek_down,
    key_store_down,
    log_lines,
    policy_bug,
    post,
    record_bug,
    release_body,
    wait_for_lines,
)
from tests.support.constants import ALLOWED, DENIED, GPU_KEY, KEY

INSTANCE_ID = Workload(image_digest=ALLOWED).instance_id  # what the development issuer says
GOLDEN = Path(__file__).resolve().parents[1] / "vectors" / "decision_records"
REGENERATE = os.environ.get("BROKER_REGENERATE_DECISION_RECORDS") == "1"
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass
class Case:
    session: aiohttp.ClientSession
    broker: RunningBroker
    monkeypatch: pytest.MonkeyPatch


# --- full-evidence releases -------------------------------------------------------------------


async def release(case: Case, **changes: Any) -> None:
    body = await release_body(case.session, case.broker, **changes)
    await post(case.session, case.broker, "/v1/release", body)


async def release_refused_by_policy(case: Case) -> None:
    await release(case, digest=DENIED)


async def release_malformed(case: Case) -> None:
    await release(case, wrap="rot13")


async def release_with_unknown_nonce(case: Case) -> None:
    await release(case, nonce="A" * 43)


async def release_with_garbage_evidence(case: Case) -> None:
    await release(case, evidence={"gca": "not-a-token"})


async def release_of_unknown_key(case: Case) -> None:
    await release(case, key="models/absent")


async def release_key_store_down(case: Case) -> None:
    key_store_down(case.monkeypatch)
    await release(case)


async def release_kek_down(case: Case) -> None:
    kek_down(case.monkeypatch)
    await release(case)


async def release_policy_bug(case: Case) -> None:
    policy_bug(case.monkeypatch)
    await release(case)


async def release_record_bug(case: Case) -> None:
    record_bug(case.monkeypatch, "release")
    await release(case)


async def release_hung_up(case: Case) -> None:
    body = await release_body(case.session, case.broker)
    await hung_up(case, lambda session: post(session, case.broker, "/v1/release", body))


async def hung_up(case: Case, send: Callable[[aiohttp.ClientSession], Awaitable[object]]) -> None:
    before = len(await asyncio.to_thread(log_lines, case.broker))
    await hang_up_while_deciding(case.broker, Gate(case.monkeypatch), send)
    await wait_for_lines(case.broker, before + 1)


# --- attestations -----------------------------------------------------------------------------


async def attest(case: Case, *, digest: str | None = None, **changes: Any) -> None:
    runner = fixed_runner(case.broker)
    options = {} if digest is None else {"digest": digest}
    body = await attest_body(case.session, runner, **options)
    await post(case.session, case.broker, "/v1/attest", {**body, **changes})


async def attest_refused_by_policy(case: Case) -> None:
    await attest(case, digest=DENIED)


async def attest_with_bad_pop_key(case: Case) -> None:
    x25519_jwk = public_jwk(x25519.X25519PrivateKey.from_private_bytes(b"x" * 32).public_key())
    await attest(case, pop_key=x25519_jwk)


async def attest_with_unknown_nonce(case: Case) -> None:
    await attest(case, nonce="A" * 43)


async def attest_store_down(case: Case) -> None:
    attestation_store_down(case.monkeypatch)
    await attest(case)


async def attest_policy_bug(case: Case) -> None:
    policy_bug(case.monkeypatch)
    await attest(case)


async def attest_record_bug(case: Case) -> None:
    record_bug(case.monkeypatch, "attestation")
    await attest(case)


async def attest_hung_up(case: Case) -> None:
    body = await attest_body(case.session, fixed_runner(case.broker))
    await hung_up(case, lambda session: post(session, case.broker, "/v1/attest", body))


# --- releases on an attestation result --------------------------------------------------------


async def on_result(
    case: Case,
    *,
    keys: tuple[str, ...] = (KEY,),
    fault: Callable[[pytest.MonkeyPatch], None] | None = None,
    authorization: str | None = None,
    again: bool = False,
) -> None:
    """Attest, inject ``fault``, release ``keys`` on the result (twice with one proof if
    ``again``)."""
    runner = fixed_runner(case.broker)
    await runner.attest(case.session)
    if fault is not None:
        fault(case.monkeypatch)
    proof = fixed_proof(runner)
    for _ in range(2 if again else 1):
        await runner.release(case.session, proof=proof, keys=keys, authorization=authorization)


async def on_result_allowed(case: Case) -> None:
    await on_result(case)


async def on_result_partly(case: Case) -> None:
    await on_result(case, keys=(KEY, DENIED_KEY))


async def on_result_refused_by_policy(case: Case) -> None:
    await on_result(case, keys=(DENIED_KEY,))


async def on_result_malformed(case: Case) -> None:
    await on_result(case, keys=(KEY, KEY))


async def on_garbage_result(case: Case) -> None:
    await on_result(case, authorization="DPoP not-a-result")


async def on_result_proof_reused(case: Case) -> None:
    await on_result(case, again=True)


async def on_result_key_store_down(case: Case) -> None:
    await on_result(case, fault=key_store_down)


async def on_result_kek_down(case: Case) -> None:
    await on_result(case, fault=kek_down)


async def on_result_policy_bug(case: Case) -> None:
    await on_result(case, fault=policy_bug)


async def on_result_bug_after_a_wrap(case: Case) -> None:
    """The first key is wrapped, the second key's policy call is a bug: the first is withdrawn."""
    await on_result(case, keys=(KEY, GPU_KEY), fault=lambda patch: policy_bug(patch, after=1))


async def on_result_record_bug(case: Case) -> None:
    await on_result(case, fault=lambda patch: record_bug(patch, "attested_release"))


async def on_result_hung_up(case: Case) -> None:
    runner = fixed_runner(case.broker)
    await runner.attest(case.session)
    proof = fixed_proof(runner)
    await hung_up(case, lambda session: runner.release(session, proof=proof))


SCENARIOS: dict[str, Callable[[Case], Awaitable[None]]] = {
    "release.allow": release,
    "release.deny-policy": release_refused_by_policy,
    "release.deny-bad-request": release_malformed,
    "release.deny-nonce-unknown": release_with_unknown_nonce,
    "release.deny-token-invalid": release_with_garbage_evidence,
    "release.deny-key-unknown": release_of_unknown_key,
    "release.error-key-store": release_key_store_down,
    "release.error-kek": release_kek_down,
    "release.internal-decide": release_policy_bug,
    "release.internal-record": release_record_bug,
    "release.cancelled": release_hung_up,
    "attestation.allow": attest,
    "attestation.deny-policy": attest_refused_by_policy,
    "attestation.deny-runner-key": attest_with_bad_pop_key,
    "attestation.deny-nonce-unknown": attest_with_unknown_nonce,
    "attestation.error-store": attest_store_down,
    "attestation.internal-decide": attest_policy_bug,
    "attestation.internal-record": attest_record_bug,
    "attestation.cancelled": attest_hung_up,
    "attested_release.allow": on_result_allowed,
    "attested_release.partial": on_result_partly,
    "attested_release.deny-policy": on_result_refused_by_policy,
    "attested_release.deny-bad-request": on_result_malformed,
    "attested_release.deny-result-invalid": on_garbage_result,
    "attested_release.deny-proof-reused": on_result_proof_reused,
    "attested_release.error-key-store": on_result_key_store_down,
    "attested_release.error-kek": on_result_kek_down,
    "attested_release.internal-decide": on_result_policy_bug,
    "attested_release.internal-withdrawn": on_result_bug_after_a_wrap,
    "attested_release.internal-record": on_result_record_bug,
    "attested_release.cancelled": on_result_hung_up,
}


def normalised(lines: list[bytes]) -> bytes:
    """The last record of ``lines``, its varying members replaced by named placeholders (the
    module docstring lists them), as a canonical JSON line."""
    line = lines[-1]
    record = json.loads(line)
    assert canonical(record) == line, "a stored record is not canonical JSON"
    for member in ("index", "seq"):
        assert record[member] == len(lines) - 1
        record[member] = "<index>"
    for member in ("prev", "hash"):
        assert HEX64.fullmatch(record[member])
        record[member] = "<hash>"
    assert re.fullmatch(r"[0-9a-f]{32}", record["request_id"])
    record["request_id"] = "<request-id>"
    for holder in [record, *record.get("keys", [])]:
        checked_input_digest(holder)
    names = {record["decision_id"]: "<decision-id>"}
    earlier = [json.loads(other) for other in lines[:-1]]
    results = [r for r in earlier if r.get("type") == "attestation" and r.get("result") == "allow"]
    if record["type"] == "attested_release" and results:
        names[results[-1]["jti"]] = "<attestation-jti>"
        if isinstance(record.get("attestation"), dict):
            assert record["attestation"]["log_index"] in (None, results[-1]["index"])
            if record["attestation"]["log_index"] is not None:
                record["attestation"]["log_index"] = "<attestation-index>"
    (policy,) = {r["new_digest"] for r in earlier if r.get("type") == "policy_change"}
    names[policy] = "<policy-digest>"
    text = canonical(record).decode()
    for value, name in names.items():
        assert UUID.fullmatch(value) or name == "<policy-digest>", value
        text = text.replace(value, name)
    assert not UUID.search(text), f"a UUID is left: {text}"
    return text.encode() + b"\n"


def checked_input_digest(holder: dict[str, Any]) -> None:
    """``holder``'s ``input_digest`` is the SHA-256 of its input, unmasked; replaced by a name
    where that input holds a UUID the broker drew."""
    if holder.get("input") is None:
        return
    policy_input = copy.deepcopy(holder["input"])
    platform = policy_input["tee"]["platform"]
    assert platform["instance_id"] == mask_value(INSTANCE_ID, MASK_KEY)  # masked, keyed
    platform["instance_id"] = INSTANCE_ID
    digest = "sha256:" + hashlib.sha256(canonical(policy_input)).hexdigest()
    assert holder["input_digest"] == digest
    if UUID.search(canonical(holder["input"]).decode()):
        holder["input_digest"] = "<input-digest>"


@pytest.mark.parametrize("scenario", list(SCENARIOS))
async def test_the_record_is_as_pinned(
    scenario: str, start_broker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = scenario.partition(".")[0]
    broker = await fixed_broker(start_broker, monkeypatch, seed=scenario)
    async with aiohttp.ClientSession() as session:
        await SCENARIOS[scenario](Case(session, broker, monkeypatch))
    lines = await asyncio.to_thread(log_lines, broker)
    assert json.loads(lines[-1])["type"] == plan
    pinned = normalised(lines)
    golden = GOLDEN / f"{scenario}.json"
    if REGENERATE:
        await asyncio.to_thread(golden.parent.mkdir, parents=True, exist_ok=True)
        await asyncio.to_thread(golden.write_bytes, pinned)
        pytest.skip(f"regenerated {golden.name}")
    assert pinned == await asyncio.to_thread(golden.read_bytes), scenario


def test_every_plan_and_outcome_is_pinned() -> None:
    """No golden file without its scenario (a stale one would pin nothing) and every plan is
    covered by allow, a refusal, an error, both bugs and a hang-up."""
    assert sorted(p.stem for p in GOLDEN.glob("*.json")) == sorted(SCENARIOS)
    for plan in PLANS:
        outcomes = {s.partition(".")[2].split("-")[0] for s in SCENARIOS if s.startswith(plan)}
        assert {"allow", "deny", "error", "internal", "cancelled"} <= outcomes, plan

"""The feeds say what the log says (issue 27): a release on an attestation result that released
one key and was refused another is ``partial`` (not ``deny``), exported to OCSF as one event per
key with its key, version, status and the attestation's identity (never ``resources: [{"name":
null}]``), and sent to syslog as a notice; every record type the broker writes has an OCSF
mapping, checked field by field on records written by a live broker (and the log repair by the
real repair writer)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from broker.audit.ocsf import MAPPINGS
from broker.core.records import RecordType
from tests.integration.attested import ADMIN, DENIED_KEY
from tests.integration.every_record import (
    EXTRA_KEY,
    every_kind_of_record,
    with_a_key_rotation,
    with_a_repair,
)
from tests.integration.identity import SPIFFE_ID
from tests.integration.kbs import RESOURCE, UNMAPPED, every_record_broker
from tests.support.cli import run
from tests.support.constants import ALLOWED, KEY
from tests.support.syslog import syslog_collector

BROKER_SOURCE = Path(__file__).parents[2] / "broker"
# a record's type as its writers spell it: {"type": "…"} literals, {"type": RecordType.X} and
# RECORD_TYPE constants (core/records.py names every type; writers use its members)
TYPE_LITERAL = re.compile(
    r'"type": "([a-z_]+)"|RECORD_TYPE = "([a-z_]+)"'
    r'|"type": RecordType\.([A-Z_]+)|RECORD_TYPE = RecordType\.([A-Z_]+)'
)
NOT_RECORDS = {"object", "string", "integer", "array", "boolean", "number", "null"}


def written_types() -> set[str]:
    """Every record type some writer in ``broker/`` writes (the OpenAPI and JSON-schema
    ``"type"`` members are not records)."""
    found: set[str] = set()
    for path in BROKER_SOURCE.rglob("*.py"):
        if path.name.startswith("openapi") or (path.parent.name == "audit" and path.stem == "ocsf"):
            continue
        for match in TYPE_LITERAL.finditer(path.read_text(encoding="utf-8")):
            literal, member = match.group(1) or match.group(2), match.group(3) or match.group(4)
            found.add(literal or RecordType[member].value)
    return found - NOT_RECORDS


def test_every_record_type_a_writer_writes_has_an_ocsf_mapping() -> None:
    types = written_types()
    assert {"release", "attested_release", "attestation", "policy_change"} <= types
    assert types <= set(MAPPINGS), sorted(types - set(MAPPINGS))
    assert set(CHECKS) == set(MAPPINGS)  # and the test below checks each mapping


def _export(log: Path) -> list[dict[str, Any]]:
    exported = run("audit", "export", str(log), "--format", "ocsf")
    assert exported.returncode == 0, exported.stderr
    return [json.loads(line) for line in exported.stdout.splitlines()]


def _epoch_ms(record: dict[str, Any]) -> int:
    return int(datetime.fromisoformat(record["time"]).timestamp() * 1000)


async def test_feeds_report_each_key_and_every_record_type(
    start_broker: Callable[..., Any], tmp_path: Path
) -> None:
    messages: list[bytes] = []
    transport, port = await syslog_collector(messages)
    try:
        broker = await every_record_broker(
            start_broker, environ={"BROKER_AUDIT_SINK": f"syslog://127.0.0.1:{port}"}
        )
        jti = await every_kind_of_record(broker)
        written = len(broker.records())
        for _ in range(200):  # the sink is best effort and asynchronous: wait for it
            if len(messages) >= written:
                break
            await asyncio.sleep(0.05)
    finally:
        transport.close()
    await asyncio.to_thread(with_a_repair, broker.settings.audit.log, tmp_path / "l")
    await with_a_key_rotation(tmp_path / "l")
    records = [json.loads(line) for line in (tmp_path / "l").read_bytes().splitlines()]
    assert {r["type"] for r in records} == written_types()  # the log holds every type
    events = await asyncio.to_thread(_export, tmp_path / "l")
    by_record: dict[Any, list[dict[str, Any]]] = {}
    for event in events:
        by_record.setdefault(event["metadata"]["sequence"], []).append(event)
    assert len(by_record) == len(records)  # every record exported
    for record in records:
        produced = by_record[record["index"]]
        for event in produced:  # the envelope every event has
            assert event["class_uid"] == 6003
            assert event["category_uid"] == 6
            assert event["type_uid"] == 600300 + event["activity_id"]
            assert event["time"] == _epoch_ms(record)
            assert event["api"]["operation"] == record["type"]
            assert event["metadata"]["log_name"] == record.get("replica")
            assert event["metadata"]["product"]["name"] == "sealed-runner key broker"
            assert event["unmapped"]["hash"] == record["hash"]
            assert all(r.get("name", "") is not None for r in event["resources"])  # no null name
        CHECKS[record["type"]](record, produced, jti)
    severities = _syslog_severities(messages)
    attested = [r for r in records if r["type"] == "attested_release"]
    assert [r["result"] for r in attested] == ["allow", "partial", "deny", "deny"]
    expected = {"allow": 6, "partial": 5, "deny": 4}  # info, notice, warning
    assert [severities[r["index"]] for r in attested] == [expected[r["result"]] for r in attested]
    changes = [r for r in records[:written] if r["type"] in ("policy_change", "key_admin")]
    assert {severities[r["index"]] for r in changes} == {5}
    (failed,) = [r for r in records if r["type"] == "policy_reload_failed"]
    assert severities[failed["index"]] == 4
    query = await asyncio.to_thread(
        run, "audit", "query", str(tmp_path / "l"), "--result", "partial"
    )
    assert query.returncode == 0, query.stderr
    rows = [json.loads(line) for line in query.stdout.splitlines()]
    assert [(r["key"], r["result"]) for r in rows] == [(KEY, "allow"), (DENIED_KEY, "deny")]
    assert {r["identity"]["image_digest"] for r in rows} == {ALLOWED}


def _syslog_severities(messages: list[bytes]) -> dict[int, int]:
    """Each record's index -> its RFC 5424 severity (facility auth: PRI 32 + severity)."""
    severities = {}
    for message in messages:
        header, _, payload = message.partition(b" - decision - ")
        priority = int(header[1 : header.index(b">")])
        assert priority // 8 == 4  # auth
        severities[json.loads(payload)["index"]] = priority % 8
    return severities


def _one(produced: list[dict[str, Any]]) -> dict[str, Any]:
    assert len(produced) == 1
    return produced[0]


def _check_release(record: dict[str, Any], produced: list[dict[str, Any]], _: str) -> None:
    event = _one(produced)
    allowed = record["result"] == "allow"
    assert (event["activity_id"], event["status_id"]) == (2, 1 if allowed else 2)
    assert event["status"] == ("Success" if allowed else "Failure")
    assert event["severity_id"] == (1 if allowed else 3)
    assert event["status_code"] == record["code"]
    assert event["resources"] == [
        {"type": "key", "name": record["key"], "version": "1", "uid": record["kid"]}
    ]
    assert event["actor"]["user"] == {
        "uid": record["identity"]["sub"],
        "name": ALLOWED,
        "account": {"uid": record["identity"]["project_id"]},
    }
    assert event["metadata"]["uid"] == record["decision_id"]
    assert event["api"]["request"]["uid"] == record["request_id"]
    assert event["unmapped"]["policy_digest"] == record["policy_digest"]
    if not allowed:
        assert event["message"] == "; ".join(record["reasons"])


def _check_attested(record: dict[str, Any], produced: list[dict[str, Any]], jti: str) -> None:
    keys = record["keys"] or [
        {"key": a["key"], "version": a["version"], "result": record["result"]}
        for a in record["asked"]
    ]
    assert len(produced) == len(keys)  # one event per key
    for n, (event, key) in enumerate(zip(produced, keys, strict=True)):
        allowed = key["result"] == "allow"
        assert (event["activity_id"], event["status_id"]) == (2, 1 if allowed else 2)
        assert event["resources"] == [
            {
                "type": "key",
                "name": key["key"],
                "version": None if key["version"] is None else str(key["version"]),
                "uid": key.get("kid"),
            }
        ]
        assert event["status_code"] == (key.get("code") if record["keys"] else record["code"])
        assert event["metadata"]["uid"] == f"{record['decision_id']}#{n}"
        assert event["metadata"]["correlation_uid"] == record["decision_id"]
        assert event["unmapped"]["dpop_jti"] == record["dpop_jti"]
        if record["keys"]:  # admitted: the attestation's identity names the actor
            assert event["actor"]["session"] == {"uid": jti}
            assert event["actor"]["user"]["name"] == ALLOWED
            assert event["unmapped"]["policy_digest"] == key["policy_digest"]
            assert event["unmapped"]["attestation_log_index"] == record["attestation"]["log_index"]
        if key["result"] == "deny" and record["keys"]:
            assert event["message"] == "; ".join(key["reasons"])


def _check_attestation(record: dict[str, Any], produced: list[dict[str, Any]], _: str) -> None:
    event = _one(produced)
    assert (event["activity_id"], event["status_id"], event["severity_id"]) == (1, 1, 1)
    assert event["resources"] == [{"type": "attestation", "uid": record["jti"]}]
    assert event["actor"]["session"] == {"uid": record["jti"]}
    assert event["actor"]["user"]["name"] == ALLOWED
    assert event["unmapped"]["expires_at"] == record["expires_at"]


def _check_identity(record: dict[str, Any], produced: list[dict[str, Any]], _: str) -> None:
    event = _one(produced)
    assert (event["activity_id"], event["status_id"], event["severity_id"]) == (1, 1, 1)
    assert event["resources"] == [
        {"type": "certificate", "uid": record["serial"], "name": SPIFFE_ID}
    ]
    assert event["actor"]["session"] == {"uid": record["attestation"]["jti"]}
    assert event["actor"]["user"]["name"] == ALLOWED
    assert event["unmapped"]["not_after"] == record["not_after"]
    assert event["unmapped"]["policy_digest"] == record["policy_digest"]


def _check_identity_ca(record: dict[str, Any], produced: list[dict[str, Any]], _: str) -> None:
    event = _one(produced)
    assert (event["activity_id"], event["status_id"], event["severity_id"]) == (3, 1, 2)
    issuer = record["chain"][0]
    assert event["resources"] == [
        {"type": "certificate_authority", "uid": issuer["sha256"], "name": record["trust_domain"]}
    ]
    assert record["ca_digest"] in event["message"]
    assert record["old_ca_digest"] is None  # the first start with [identity] on
    assert event["unmapped"]["subject"] == issuer["subject"]


def _check_revoked(record: dict[str, Any], produced: list[dict[str, Any]], jti: str) -> None:
    event = _one(produced)
    assert record["jti"] == jti
    assert (event["activity_id"], event["status_id"], event["severity_id"]) == (3, 1, 2)
    assert event["resources"] == [{"type": "attestation", "uid": jti}]
    assert event["message"] == "feeds test"
    assert event["actor"]["user"] == {"uid": record["who"], "name": record["who"]}
    assert record["who"].startswith("token:")


def _check_policy_change(record: dict[str, Any], produced: list[dict[str, Any]], _: str) -> None:
    event = _one(produced)
    assert (event["activity_id"], event["status_id"]) == (3, 1)
    assert event["resources"] == [
        {"type": "policy", "uid": record["new_digest"], "name": record["source"]}
    ]
    assert record["new_digest"] in event["message"]
    assert record["trigger"] in event["message"]
    assert event["actor"]["user"]["uid"] == record["who"]
    assert event["unmapped"]["old_digest"] == record["old_digest"]


def _check_reload_failed(record: dict[str, Any], produced: list[dict[str, Any]], _: str) -> None:
    event = _one(produced)
    assert (event["activity_id"], event["status_id"], event["severity_id"]) == (3, 2, 3)
    assert event["status_code"] == "policy_invalid"
    assert event["message"] == record["problem"]
    assert event["resources"] == [
        {"type": "policy", "uid": record["active_digest"], "name": record["source"]}
    ]
    assert event["actor"]["user"]["uid"] == record["who"]


def _check_key_admin(record: dict[str, Any], produced: list[dict[str, Any]], _: str) -> None:
    event = _one(produced)
    assert record["action"] == "create"
    intent = "result" not in record  # written before the store is touched: not made yet
    assert record.get("phase") == ("intent" if intent else None)
    assert event["unmapped"]["phase"] == record.get("phase")
    status = (0, "Unknown") if intent else (1, "Success")  # an intent is no successful create
    assert (event["activity_id"], event["status_id"], event["status"], event["message"]) == (
        1,
        *status,
        "create",
    )
    assert event["severity_id"] == 1
    assert event["resources"] == [{"type": "key", "name": EXTRA_KEY, "version": "1", "uid": None}]
    assert event["actor"]["user"]["uid"] == record["who"]
    assert record["who"] == f"token:{ADMIN_DIGEST[:12]}"


def _check_key_rotation(record: dict[str, Any], produced: list[dict[str, Any]], _: str) -> None:
    event = _one(produced)
    assert (event["activity_id"], event["status_id"], event["severity_id"]) == (3, 1, 2)
    assert event["resources"] == [{"type": "log", "name": record["origin"]}]
    assert record["old_key"] in event["message"]
    assert record["new_key"] in event["message"]
    assert record["old_key"] != record["new_key"]
    assert event["unmapped"]["tree_size"] == record["tree_size"]


def _check_repair(record: dict[str, Any], produced: list[dict[str, Any]], _: str) -> None:
    event = _one(produced)
    assert (event["activity_id"], event["status_id"], event["severity_id"]) == (3, 1, 3)
    assert str(record["removed_bytes"]) in event["message"]
    assert event["unmapped"]["removed_sha256"] == record["removed_sha256"]


def _check_kbs_auth(record: dict[str, Any], produced: list[dict[str, Any]], _: str) -> None:
    event = _one(produced)
    assert (event["activity_id"], event["status_id"], event["severity_id"]) == (1, 1, 1)
    session = record["kbs"]["session"]
    assert session is not None
    assert event["resources"] == [{"type": "kbs_session", "uid": session}]
    assert event["actor"] == {"user": {"uid": None, "name": "sample"}, "session": {"uid": session}}
    assert event["unmapped"]["kbs"] == record["kbs"]


def _check_kbs_attest(record: dict[str, Any], produced: list[dict[str, Any]], _: str) -> None:
    event = _one(produced)
    assert (event["activity_id"], event["status_id"], event["severity_id"]) == (1, 1, 1)
    assert event["resources"] == [{"type": "attestation", "uid": record["jti"]}]
    assert event["actor"]["session"] == {"uid": record["jti"]}
    assert event["unmapped"]["kbs"]["tee"] == "sample"
    assert event["unmapped"]["expires_at"] == record["expires_at"]


def _check_kbs_resource(record: dict[str, Any], produced: list[dict[str, Any]], _: str) -> None:
    event = _one(produced)
    allowed = record["result"] == "allow"
    assert (event["activity_id"], event["status_id"]) == (2, 1 if allowed else 2)
    assert event["status_code"] == record["code"]
    named = [{"type": "key", "name": KEY, "version": "1", "uid": record["kid"]}]
    assert event["resources"] == (named if allowed else [])  # refused before its key: none
    assert event["actor"]["session"] == {"uid": record["attestation"]["jti"]}
    assert event["unmapped"]["kbs"]["path"] == (RESOURCE if allowed else UNMAPPED)
    assert event["unmapped"]["attestation_log_index"] == record["attestation"]["log_index"]


CHECKS: dict[str, Callable[[dict[str, Any], list[dict[str, Any]], str], None]] = {
    "release": _check_release,
    "attested_release": _check_attested,
    "attestation": _check_attestation,
    "attestation_revoked": _check_revoked,
    "policy_change": _check_policy_change,
    "policy_reload_failed": _check_reload_failed,
    "key_admin": _check_key_admin,
    "log_repair": _check_repair,
    "log_key_rotation": _check_key_rotation,
    "identity": _check_identity,
    "identity_ca": _check_identity_ca,
    "kbs_auth": _check_kbs_auth,
    "kbs_attest": _check_kbs_attest,
    "kbs_resource": _check_kbs_resource,
}
ADMIN_DIGEST = hashlib.sha256(ADMIN.encode()).hexdigest()

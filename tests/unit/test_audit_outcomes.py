"""How the feeds read a record's outcome (issue 27): key by key for a release on an attestation
result, so one that released a key and was refused another is never reported as a denial —
records written before ``partial`` existed included."""

from __future__ import annotations

import json
from typing import Any

import pytest

from broker.audit.ocsf import ocsf_events
from broker.audit.outcomes import outcome, overall
from broker.audit.sink import syslog_message, syslog_severity


@pytest.mark.parametrize(
    ("results", "expected"),
    [
        (["allow"], "allow"),
        (["allow", "allow"], "allow"),
        (["allow", "deny"], "partial"),
        (["error", "allow"], "partial"),
        (["deny", "deny"], "deny"),
        (["deny", "error"], "error"),
    ],
)
def test_a_requests_result_follows_its_keys(results: list[str], expected: str) -> None:
    assert overall(results) == expected


def _old_partial() -> dict[str, Any]:
    """An ``attested_release`` as brokers wrote it before issue 27: ``deny`` on top although a
    key was released."""
    return {
        "type": "attested_release",
        "index": 7,
        "time": "2026-12-01T12:00:00+00:00",
        "decision_id": "d-1",
        "result": "deny",
        "attestation": {"jti": "a-1", "log_index": 3},
        "keys": [
            {"key": "models/a", "version": 2, "kid": "models/a#2", "result": "allow"},
            {"key": "models/b", "version": 1, "kid": "models/b#1", "result": "deny",
             "code": "policy_denied", "reasons": ["not for this image"]},
        ],
    }  # fmt: skip


def test_an_old_record_that_released_a_key_is_reported_as_partial() -> None:
    record = _old_partial()
    assert outcome(record) == "partial"
    assert syslog_severity(record) == 5  # notice, not the warning it used to be
    message = syslog_message(json.dumps(record).encode())
    assert message.startswith(b"<37>1 ")  # auth (4) * 8 + notice (5)
    events = ocsf_events(record)
    assert [(e["resources"][0]["name"], e["status"]) for e in events] == [
        ("models/a", "Success"),
        ("models/b", "Failure"),
    ]
    assert {e["actor"]["session"]["uid"] for e in events} == {"a-1"}


@pytest.mark.parametrize(
    ("record", "severity"),
    [
        ({"type": "release", "result": "allow"}, 6),
        ({"type": "release", "result": "deny"}, 4),
        ({"type": "release", "result": "error"}, 3),
        ({"type": "policy_change"}, 5),
        ({"type": "key_admin", "action": "create"}, 5),
        ({"type": "policy_reload_failed"}, 4),
        ({"type": "log_repair"}, 4),
    ],
)
def test_syslog_severity_by_record(record: dict[str, Any], severity: int) -> None:
    assert syslog_severity(record) == severity


def test_a_record_of_an_unknown_type_is_exported_as_unknown_not_dropped() -> None:
    (event,) = ocsf_events({"type": "from_a_newer_broker", "index": 1, "time": "x"})
    assert (event["status_id"], event["activity_id"], event["time"]) == (0, 99, 0)
    assert event["metadata"]["sequence"] == 1

"""Reading key changes back from a decision log: every change is an intent, then its outcome
(``broker/keys/changes.py``), and the outcome names its intent's leaf index."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from broker.audit.log import DecisionLog


async def key_admin_records(log: DecisionLog) -> list[dict[str, Any]]:
    """The ``key_admin`` records of ``log``, in order."""
    lines = await asyncio.to_thread(log.read_lines, 0, log.committed_size)
    return [r for r in map(json.loads, lines) if r["type"] == "key_admin"]


def outcomes(records: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """(action, version, result, code) of every outcome, each checked against its intent: an
    earlier record without ``result``, of the same action, key and version."""
    by_index = {r["index"]: r for r in records}
    found = []
    for record in records:
        if "result" not in record:
            continue
        intent = by_index[record["intent"]]
        assert intent["index"] < record["index"]
        assert "result" not in intent
        expected = "rewrap-start" if record["action"] == "rewrap" else record["action"]
        assert intent["action"] == expected
        assert (intent.get("key"), intent.get("version")) == (
            record.get("key"),
            record.get("version"),
        )
        found.append(
            (record["action"], record.get("version"), record["result"], record.get("code"))
        )
    return found


def unanswered(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The intents no outcome names (unknown: the store says)."""
    answered = {r["intent"] for r in records if "result" in r}
    return [r for r in records if "result" not in r and r["index"] not in answered]

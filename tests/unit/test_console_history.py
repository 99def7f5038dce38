"""The policy history's index (``broker/console/history.py``): found once, extended with what
was written since, bounded, and paged through newest first."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from broker.audit.log import DecisionLog
from broker.console import history
from broker.console.history import HistoryIndex


async def _append(log: DecisionLog, *types: str) -> None:
    for kind in types:
        await log.append({"type": kind, "time": "2026-12-02T12:00:00+00:00", "reasons": [kind]})


async def test_the_index_grows_with_the_log_and_pages_newest_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = DecisionLog(tmp_path / "d.log")
    await log.open()
    try:
        # a release whose reason names a policy type is not a policy record
        await _append(log, "policy_change", "release", "policy_reload_failed", "release")
        await log.append({"type": "release", "reasons": ['"policy_change"']})
        index = HistoryIndex()
        await asyncio.to_thread(index.update, log)
        found = await asyncio.to_thread(index.page, log, None)
        assert [r.index for r in found.records] == [2, 0]
        assert (found.first, found.total, found.size, found.dropped) == (1, 2, 5, False)
        assert found.links == {"older": None, "newer": None, "newest": None}

        await _append(log, "policy_change", "release")  # written after: found at the next
        await asyncio.to_thread(index.update, log)
        monkeypatch.setattr(history, "SHOWN", 2)
        newest = await asyncio.to_thread(index.page, log, None)
        assert [r.index for r in newest.records] == [5, 2]
        assert newest.links == {"older": "/console/policy?end=2", "newer": None, "newest": None}
        older = await asyncio.to_thread(index.page, log, 2)
        assert [r.index for r in older.records] == [0]
        assert older.links == {
            "older": None,
            "newer": "/console/policy",
            "newest": "/console/policy",
        }

        monkeypatch.setattr(history, "MAX_INDEXED", 2)  # only the newest places are kept
        await _append(log, "policy_reload_failed")
        await asyncio.to_thread(index.update, log)
        kept = await asyncio.to_thread(index.page, log, None)
        assert [r.index for r in kept.records] == [7, 5]
        assert (kept.total, kept.dropped) == (2, True)
    finally:
        await log.close()

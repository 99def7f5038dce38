"""connect_wal: concurrent first opens of one file all succeed; a lock held too long fails."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest

from broker.core.sqlite_wal import connect_wal


def test_concurrent_first_opens_of_one_file_all_get_wal(tmp_path: Path) -> None:
    """Eight threads open each fresh file in the same instant (plain PRAGMA failed ~1 in 13)."""
    failures: list[BaseException] = []
    for trial in range(40):
        path = tmp_path / f"{trial}.db"
        barrier = threading.Barrier(8)

        def open_one(target: Path = path, start: threading.Barrier = barrier) -> None:
            start.wait()
            try:
                db = connect_wal(target, timeout=5.0)
                try:
                    db.execute("CREATE TABLE IF NOT EXISTS t (a)")
                    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
                finally:
                    db.close()
            except BaseException as exc:  # collected and asserted below, in the test's thread
                failures.append(exc)

        threads = [threading.Thread(target=open_one) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert failures == []


def test_a_lock_held_past_the_timeout_is_an_operational_error(tmp_path: Path) -> None:
    path = tmp_path / "held.db"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE t (a)")
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            connect_wal(path, timeout=0.2)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    db = connect_wal(path, timeout=1.0)
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    db.close()

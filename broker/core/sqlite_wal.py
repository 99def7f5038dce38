"""Opening a SQLite database in WAL mode when other processes may be opening it too.

``PRAGMA journal_mode=WAL`` can answer ``database is locked`` at once, without waiting the
connection's busy timeout: SQLite does not call the busy handler for every lock it takes while
it changes or checks the journal mode (seen in CI: two store instances opened on one file in the
same instant, one failed). So the pragma is retried here until the same timeout has passed;
past it the caller's ``sqlite3.OperationalError`` stands, as any other lock timeout does.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

_PAUSE = 0.01


def connect_wal(path: Path, *, timeout: float) -> sqlite3.Connection:
    """An autocommit connection to ``path`` in WAL mode with ``synchronous=FULL``.

    Raises: ``sqlite3.OperationalError`` when the file stays locked past ``timeout`` seconds,
    ``sqlite3.Error`` / ``OSError`` for anything else."""
    db = sqlite3.connect(path, timeout=timeout, isolation_level=None)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                db.execute("PRAGMA journal_mode=WAL")
                break
            except sqlite3.OperationalError as exc:
                if not _is_lock(exc) or time.monotonic() >= deadline:
                    raise
                time.sleep(_PAUSE)
        db.execute("PRAGMA synchronous=FULL")
    except BaseException:
        db.close()
        raise
    return db


def _is_lock(exc: sqlite3.OperationalError) -> bool:
    text = str(exc)
    return "locked" in text or "busy" in text

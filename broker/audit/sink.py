"""Streaming decision records to a SIEM as they are written: ``[audit] sink``.

* ``syslog://HOST:PORT`` — one RFC 5424 message per record over UDP (facility auth), the
  record's JSON as the message; the severity follows what the record released, key by key for a
  release on an attestation result (``syslog_severity``): info when every key was released,
  notice when some were (``partial``), warning when none was (deny), error when the broker
  failed; changes are notice, a refused policy reload or a repaired log warning;
* ``https://HOST/PATH`` (``http://`` only on loopback) — batches POSTed as JSON lines.

Best effort, by design: the local log is the system of record (checkpoints commit to it). A
bounded queue sits between the log and the sender; when the SIEM is slow or away, the oldest
records are dropped from the queue (counted in ``broker_audit_sink_dropped_total``), a release is
never delayed, and ``broker audit export`` recovers anything missed.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from broker.audit.envelope import Envelope, RecordError, parse_record
from broker.audit.outcomes import ALLOW, DENY, ERROR, PARTIAL
from broker.core.metrics import Metrics
from broker.core.records import ChangeResult, RecordType

log = logging.getLogger(__name__)
QUEUE_RECORDS = 10_000
BATCH_RECORDS = 200
SYSLOG_FACILITY_AUTH = 4
ERR, WARNING, NOTICE, INFO = 3, 4, 5, 6  # RFC 5424 severities
SEVERITIES = {ALLOW: INFO, PARTIAL: NOTICE, DENY: WARNING, ERROR: ERR}
# a key change's outcome (keys/changes.py): made notice, not made error, may be made warning
CHANGE_SEVERITIES: dict[str, int] = {
    ChangeResult.OK: NOTICE,
    ChangeResult.ERROR: ERR,
    ChangeResult.UNKNOWN: WARNING,
}
# records without a result that an operator must look at
ATTENTION = frozenset({RecordType.POLICY_RELOAD_FAILED, RecordType.LOG_REPAIR})


class AuditSink:
    def __init__(self, url: str, session: aiohttp.ClientSession, metrics: Metrics) -> None:
        self._url = url
        self._parts = urlsplit(url)
        self._session = session
        self._metrics = metrics
        self._queue: asyncio.Queue[bytes] = asyncio.Queue(QUEUE_RECORDS)
        self._socket: socket.socket | None = None

    def offer(self, lines: list[bytes]) -> None:
        """Queue written records (called on the event loop after each durable batch)."""
        for line in lines:
            if self._queue.full():
                self._queue.get_nowait()
                self._metrics.sink_dropped.inc()
            self._queue.put_nowait(line)

    async def run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while not self._queue.empty() and len(batch) < BATCH_RECORDS:
                batch.append(self._queue.get_nowait())
            try:
                await self.deliver(batch)
                self._metrics.sink_sent.inc(len(batch))
            except (OSError, aiohttp.ClientError, TimeoutError) as exc:
                self._metrics.sink_dropped.inc(len(batch))
                log.warning(
                    "audit sink %s: %d record(s) not delivered: %s", self._url, len(batch), exc
                )

    async def deliver(
        self, batch: list[bytes], *, event: str = "decision", severity: int | None = None
    ) -> None:
        """Send ``batch`` now, without the queue (``run``; ``broker audit monitor``'s watch
        hits: ``event`` is the syslog MSGID, ``severity`` overrides the record's).

        Raises:
            OSError, aiohttp.ClientError, TimeoutError: not delivered.
        """
        if self._parts.scheme == "syslog":
            await self._syslog(batch, event, severity)
        else:
            await self._post(batch)

    async def _post(self, batch: list[bytes]) -> None:
        body = b"".join(line + b"\n" for line in batch)
        timeout = aiohttp.ClientTimeout(total=5)
        async with self._session.post(
            self._url, data=body, headers={"Content-Type": "application/x-ndjson"}, timeout=timeout
        ) as reply:
            if reply.status >= 300:
                raise aiohttp.ClientResponseError(reply.request_info, (), status=reply.status)

    async def _syslog(self, batch: list[bytes], event: str, severity: int | None) -> None:
        if self._socket is None:
            self._socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self._socket.setblocking(False)
        loop = asyncio.get_running_loop()
        address = (self._parts.hostname or "127.0.0.1", self._parts.port or 514)
        for line in batch:
            message = syslog_message(line, event=event, severity=severity)
            await loop.sock_sendto(self._socket, message, address)

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()


def syslog_severity(record: Envelope | Mapping[str, Any]) -> int:
    """RFC 5424 severity of a record (its envelope): decisions by their outcome (per key,
    ``Envelope.outcome``), changes notice, a key change's outcome by its ``result`` (``ok``
    notice, ``unknown`` warning, ``error`` error), what an operator must look at warning.

    Raises:
        RecordError: ``record`` is not a record (not an object).
    """
    envelope = record if isinstance(record, Envelope) else parse_record(record)
    result = envelope.outcome
    if result is not None and envelope.kind is RecordType.KEY_ADMIN:
        return CHANGE_SEVERITIES.get(result, WARNING)
    if result is not None:
        return SEVERITIES.get(result, WARNING)
    return WARNING if envelope.kind in ATTENTION else NOTICE


def syslog_message(line: bytes, *, event: str = "decision", severity: int | None = None) -> bytes:
    """RFC 5424: ``<PRI>1 TIMESTAMP HOST APP - MSGID - MSG``; MSGID ``event``; without
    ``severity``, the record's (a line that is not a record, never written by the log, is sent
    as it is, a warning)."""
    if severity is None:
        try:
            severity = syslog_severity(parse_record(line))
        except RecordError:
            severity = WARNING
    priority = SYSLOG_FACILITY_AUTH * 8 + severity
    stamp = datetime.now(UTC).isoformat().replace("+00:00", "Z")
    header = f"<{priority}>1 {stamp} {socket.gethostname()} sealed-broker - {event} - "
    return header.encode() + line

"""The keys page: what the log says each key and version was released to, next to the key
store's list.

``GET /console/keys?key=&image=&replica=&end=&records=`` reads a window of the log
(``reading.py``) and folds, through the query code's rows and filters (a release on an
attestation result is one row per key):

* per key and version: releases allowed and refused, the distinct images and recipient keys
  (the runner key each DEK was wrapped to) it was released to, the last release;
* the attestation results issued in the window, and what each released (key and version,
  how many times), and whether and by whom it was revoked;
* the revocations of attestation results, and the key changes (``key_admin`` outcomes);
* the versions the key store lists that no release in the window allowed ("never released"
  reads "not released among these records": older windows, or ``broker audit query --key``
  over every segment, answer for the whole log).

Every list is bounded (``SHOWN``, ``MAX_STORE_VERSIONS``); counts are exact for the window.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from broker.api.services import DECISIONS, KEYS
from broker.audit.envelope import RELEASING, Envelope, KeyDecision
from broker.audit.log import DecisionLog
from broker.audit.outcomes import ALLOW, DENY
from broker.audit.query import Filters, rows
from broker.console.reading import (
    ATTESTATIONS,
    Window,
    filters_of,
    paging,
    read,
    window_of,
)
from broker.console.templates import render
from broker.console.work import console_read
from broker.core.errors import InputError, UpstreamError
from broker.core.records import ChangeResult, RecordType

SHOWN = 100  # attestation results, revocations and key changes listed (the newest)
LISTED = 5  # images named per key version (the count is exact)
MAX_STORE_VERSIONS = 1_000  # key versions of the store's list shown
READ = RELEASING | ATTESTATIONS | {RecordType.ATTESTATION_REVOKED, RecordType.KEY_ADMIN}


@dataclass
class KeyUse:
    """One key version's releases among the records read."""

    key: str
    version: int | None
    released: int = 0
    refused: int = 0
    images: Counter[str] = field(default_factory=Counter)
    recipients: set[str] = field(default_factory=set)
    attestations: set[str] = field(default_factory=set)
    last: Envelope | None = None  # the newest allowed release

    def add(self, record: Envelope, result: str | None) -> None:
        if result == DENY:
            self.refused += 1
            return
        if result != ALLOW:
            return
        self.released += 1
        self.last = record
        image = record.identity.get("image_digest")
        if isinstance(image, str) and image:  # a KBS guest has none (raw evidence: "")
            self.images[image] += 1
        recipient = record.body.get("runner_key_thumbprint")
        if isinstance(recipient, str):
            self.recipients.add(recipient)
        if record.attestation is not None and record.attestation.jti is not None:
            self.attestations.add(record.attestation.jti)


@dataclass
class AttestationUse:
    """An attestation result: its record (None: issued before the window), what it released."""

    jti: str
    record: Envelope | None = None
    released: Counter[str] = field(default_factory=Counter)  # "key vN" -> releases
    revoked: Envelope | None = None


@dataclass
class Keys:
    """What the keys page shows, folded from one window."""

    span: Window
    uses: dict[tuple[str, int | None], KeyUse] = field(default_factory=dict)
    attestations: dict[str, AttestationUse] = field(default_factory=dict)
    revocations: deque[Envelope] = field(default_factory=lambda: deque(maxlen=SHOWN))
    changes: deque[Envelope] = field(default_factory=lambda: deque(maxlen=SHOWN))

    def add(self, record: Envelope, filters: Filters) -> None:
        jti = None if record.attestation is None else record.attestation.jti
        if record.kind in RELEASING:
            for row in rows(record):
                if row.key is not None and row.key.key is not None and filters.matches(row):
                    self._release(record, row.key, row.result, jti)
        elif record.kind in ATTESTATIONS and jti is not None and _passes(record, filters):
            self._attestation(jti).record = record
        elif record.kind is RecordType.ATTESTATION_REVOKED and filters.key is None:
            self.revocations.append(record)
            if jti is not None:
                self._attestation(jti).revoked = record
        elif record.kind is RecordType.KEY_ADMIN and _change_shown(record, filters):
            self.changes.append(record)

    def _release(
        self, record: Envelope, key: KeyDecision, result: str | None, jti: str | None
    ) -> None:
        name = str(key.key)
        use = self.uses.setdefault((name, key.version), KeyUse(name, key.version))
        use.add(record, result)
        if result == ALLOW and jti is not None:
            self._attestation(jti).released[f"{name} v{key.version}"] += 1

    def _attestation(self, jti: str) -> AttestationUse:
        return self.attestations.setdefault(jti, AttestationUse(jti))

    def results(self, filters: Filters) -> list[AttestationUse]:
        """The newest ``SHOWN`` attestation results issued, used or revoked in the window (with
        a key filter: those that released it), newest first."""
        shown = [
            a
            for a in self.attestations.values()
            if (a.record is not None or a.released or a.revoked is not None)
            and (filters.key is None or a.released)
        ]
        shown.sort(key=_order, reverse=True)
        return shown[:SHOWN]


def _order(use: AttestationUse) -> int:
    """The newest leaf index of its own records in the window (issued, revoked)."""
    indices = [r.index for r in (use.record, use.revoked) if r is not None and r.index is not None]
    return max(indices, default=-1)


def _change_shown(record: Envelope, filters: Filters) -> bool:
    """A key change's outcome (its intent has no result), of the filtered key if any."""
    return record.result is not None and filters.key in (None, record.key)


def _passes(record: Envelope, filters: Filters) -> bool:
    """An attestation result by the filters a record without a key can be held to."""
    checks = (
        (filters.image, record.identity.get("image_digest")),
        (filters.replica, record.replica),
    )
    return all(wanted is None or wanted == found for wanted, found in checks)


def _read(decisions: DecisionLog, span: Window, filters: Filters) -> Keys:
    keys = Keys(span)
    for record in read(decisions, span, READ):
        keys.add(record, filters)
    return keys


def _never_released(stored: list[dict[str, Any]], keys: Keys) -> list[dict[str, Any]]:
    released = {k for k, use in keys.uses.items() if use.released}
    return [v for v in stored if (v["name"], v["version"]) not in released]


@dataclass(frozen=True)
class VersionRow:
    """A key version the window names, with the store's metadata (None: not in the store)."""

    use: KeyUse
    stored: dict[str, Any] | None


def _versions(keys: Keys, stored: list[dict[str, Any]]) -> list[VersionRow]:
    """One row per key version the window names, sorted by name and version."""
    states = {(v["name"], v["version"]): v for v in stored}
    found = [VersionRow(use, states.get(named)) for named, use in keys.uses.items()]
    return sorted(found, key=lambda row: (row.use.key, row.use.version or 0))


async def _stored(request: web.Request, key: str | None) -> tuple[list[dict[str, Any]], str | None]:
    """The key store's versions (metadata only; of ``key`` when filtered), or why not."""
    try:
        versions = await request.app[KEYS].list_versions(key)
    except UpstreamError as exc:
        return [], f"the key store did not answer ({exc.code.value}): {exc.message}"
    return [v.describe() for v in versions[:MAX_STORE_VERSIONS]], (
        None
        if len(versions) <= MAX_STORE_VERSIONS
        else f"the key store lists {len(versions)} versions; the first {MAX_STORE_VERSIONS} shown"
    )


async def keys_page(request: web.Request) -> web.Response:
    """``GET /console/keys``."""
    problem, keys = None, None
    try:
        filters = filters_of(request)
        decisions = request.app[DECISIONS]
        await decisions.refresh()
        span = window_of(request.query, decisions)
    except InputError as exc:
        problem = exc.message
    else:
        keys = await console_read(request, _read, decisions, span, filters)
    stored, store_problem = await _stored(request, None if keys is None else filters.key)
    return render(
        request,
        "keys.html",
        status=200 if problem is None else 400,
        title="Keys",
        problem=problem,
        query=request.query,
        intervals=None,
        span=None if keys is None else keys.span,
        links=None if keys is None else paging(request, keys.span),
        versions=[] if keys is None else _versions(keys, stored),
        never=[] if keys is None else _never_released(stored, keys),
        store_problem=store_problem,
        results=[] if keys is None else keys.results(filters),
        revocations=[] if keys is None else list(reversed(keys.revocations)),
        changes=[] if keys is None else list(reversed(keys.changes)),
        listed=LISTED,
        ok=ChangeResult.OK.value,
    )

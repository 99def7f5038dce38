"""The policy history, and the replay impact of a candidate policy uploaded for comparison.

``GET /console/policy?end=`` lists every ``policy_change`` and ``policy_reload_failed`` record
of the log, newest first, a page at a time (``history.py``: who, trigger, revision, digest, the
previous digest, signature and version, the reload's problem).

``POST /console/policy/compare`` (a form: ``bundle``, a ``.tar.gz`` as ``broker policy build``
writes it, signed or not; ``records``, ``end``) re-decides the decisions of a window of the log
with the candidate — the comparison ``broker policy replay`` prints (``decisions/replay.py``) —
and shows the counts and the newest changed decisions. **Compare only**: the candidate is read
(``opa_bundle.read_bundle``: a signed one verified with ``[policy] bundle_verification_key``
when the broker has one, else compared unverified and said so), held to the structure rules
and compiled by the pinned ``opa`` as a reload would (``build.load_verified_bundle``), used for
this answer and dropped. Nothing here reaches the policy manager: the auditor role cannot
change policy. Bounded: ``MAX_CANDIDATE_BYTES`` per upload (read before the comparison lock is
taken: a slow upload holds no one up), ``MAX_REPLAY_RECORDS`` records re-decided within
``COMPARE_SECONDS`` (past it the comparison stops and the page says after how many records),
one comparison at a time per worker (``COMPARING``), the form ``Origin``-checked as every
console POST. A candidate that fails at run time (a conflict between its rules' values, its
evaluation budget spent) is the candidate's problem, not the broker's: ``400`` with the record
it failed on and OPA's message, logged at INFO — never ``policy_unavailable``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shlex
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError

from broker.api.services import DECISIONS, POLICY, SETTINGS
from broker.audit.log import DecisionLog
from broker.config import PolicySettings
from broker.console.auth import check_origin
from broker.console.history import history
from broker.console.reading import DEFAULT_RECORDS, Window, read, window_of
from broker.console.session import SESSION
from broker.console.templates import render
from broker.console.work import console_read
from broker.core.errors import BodyTooLarge, ConfigError, InputError, RequestTimeout, UpstreamError
from broker.core.records import DECISION_TYPES
from broker.decisions.replay import SUMMARY, Changed, Replay
from broker.policy import opa_bundle
from broker.policy.build import load_verified_bundle
from broker.policy.testing import find_opa
from broker.policy.wasm import CompiledPolicy, EvaluationFailed, PolicyLoadError

MAX_CANDIDATE_BYTES = 4 * 1024 * 1024  # an uploaded bundle (the default policy's is ~120 KiB)
MAX_REPLAY_RECORDS = DEFAULT_RECORDS  # records whose decisions one comparison re-decides
COMPARE_SECONDS = 30.0  # one comparison's time; past it, it stops and says where
MAX_FIELD_BYTES = 64  # ``records``, ``end``
MAX_PARTS = 4
CHANGES_SHOWN = 100  # the newest changed decisions listed (the counts are exact)
CANDIDATE = "the uploaded candidate"
COMPARING: web.AppKey[asyncio.Lock] = web.AppKey("console_comparing", asyncio.Lock)
FORM_FIELDS = ("end", "records")
log = logging.getLogger(__name__)


class CandidateFailed(Exception):
    """The candidate stopped with a run-time error on a record's decision."""

    def __init__(self, index: int | None, problem: str) -> None:
        where = "a record" if index is None else f"record {index}"
        super().__init__(f"the candidate failed on {where}: {problem}")


async def history_page(request: web.Request) -> web.Response:
    """``GET /console/policy``."""
    return await _page(request, None, None)


async def _page(
    request: web.Request, comparison: Comparison | None, problem: str | None, status: int = 200
) -> web.Response:
    decisions, settings = request.app[DECISIONS], request.app[SETTINGS]
    await decisions.refresh()
    found, history_problem = None, None
    try:
        found = await history(request.app, decisions, request.query)
    except InputError as exc:
        history_problem, status = exc.message, 400
    return render(
        request,
        "policy.html",
        status=status,
        title="Policy history",
        problem=history_problem,
        history=found,
        in_force=request.app[POLICY].digest,
        verification=settings.policy.bundle_verification_key is not None,
        comparison=comparison,
        printed=None if comparison is None else comparison.printed(),
        command=None if comparison is None else comparison.command(str(settings.audit.log)),
        compare_problem=problem,
        summary=SUMMARY,
        max_candidate_kib=MAX_CANDIDATE_BYTES // 1024,
        max_replay=MAX_REPLAY_RECORDS,
        compare_seconds=int(COMPARE_SECONDS),
        stopped_at=None if comparison is None else comparison.stopped_at,
        shown=CHANGES_SHOWN,
    )


@dataclass
class Comparison:
    """A candidate re-deciding a window's decisions: counts, and the newest changes."""

    compiled: CompiledPolicy
    span: Window
    verified: bool  # its signature checked with the broker's bundle key
    summary: dict[str, int] = field(default_factory=dict)
    changes: deque[Changed] = field(default_factory=lambda: deque(maxlen=CHANGES_SHOWN))
    since: str | None = None  # the time of the window's first decision record
    records: int = 0  # decision records compared
    stopped_at: int | None = None  # COMPARE_SECONDS passed: the last record compared

    def printed(self) -> list[str]:
        """What ``broker policy replay`` prints for these decisions: a JSON line per changed
        decision (the newest ``CHANGES_SHOWN``), then the summary line."""
        last = {"summary": self.summary, "policy_digest": self.compiled.digest}
        return [json.dumps(c.as_json()) for c in self.changes] + [json.dumps(last)]

    def command(self, log: str) -> str:
        """The ``broker policy replay`` that re-decides these decisions (and any newer)."""
        command = ["broker", "policy", "replay", "--log", log, "--policy", "candidate.tar.gz"]
        if self.verified:
            command += ["--verification-key", "KEY.pem", "--scope", "SCOPE"]
        return shlex.join(command + ([] if self.since is None else ["--since", self.since]))


async def compare(request: web.Request) -> web.Response:
    """``POST /console/policy/compare`` (multipart form: ``bundle``, ``records``, ``end``)."""
    check_origin(request)
    try:
        fields = await _form(request)  # before the lock: the upload holds up no one else
    except InputError as exc:  # not the form, too large, too slow
        return await _page(request, None, exc.message, exc.status)
    lock = request.app[COMPARING]
    if lock.locked():
        return await _page(request, None, "another comparison is running here; try again", 429)
    async with lock:
        comparison, problem, status = await _compared(request, fields)
    return await _page(request, comparison, problem, status)


async def _compared(
    request: web.Request, fields: dict[str, Any]
) -> tuple[Comparison | None, str | None, int]:
    """The candidate compared, or the problem that stopped it and the status to say it with."""
    try:
        decisions = request.app[DECISIONS]
        await decisions.refresh()
        span = window_of(fields, decisions, maximum=MAX_REPLAY_RECORDS)
        compiled, verified = await console_read(
            request, _candidate, fields["bundle"], request.app[SETTINGS].policy
        )
        comparison = await console_read(request, _compare, decisions, span, compiled, verified)
    except InputError as exc:  # ``records`` or ``end``
        return None, exc.message, exc.status
    except CandidateFailed as exc:  # the candidate's problem, not the broker's policy's
        log.info("console: %s compared a candidate that failed: %s", request[SESSION].who, exc)
        return None, str(exc), 400
    except PolicyLoadError as exc:  # the candidate: does not read, verify or compile
        return None, str(exc), 400
    except ConfigError as exc:  # no opa here to compile it with
        return None, f"cannot compile a candidate here: {exc}", 503
    return comparison, None, 200


async def _form(request: web.Request) -> dict[str, Any]:
    """The form's fields, the bundle as bytes (at most ``MAX_CANDIDATE_BYTES``).

    Raises:
        InputError: not the form, a field too large, no bundle, or a body that breaks off.
    """
    if request.content_type != "multipart/form-data":
        raise InputError("upload the candidate with the form of /console/policy")
    declared = request.content_length
    if declared is not None and declared > MAX_CANDIDATE_BYTES + MAX_PARTS * 1024:
        raise BodyTooLarge(f"a candidate bundle is at most {MAX_CANDIDATE_BYTES} bytes")
    server = request.app[SETTINGS].server
    found: dict[str, Any] = {}
    try:
        async with asyncio.timeout(server.body_timeout_seconds):
            async for name, part in _parts(request):
                limit = MAX_CANDIDATE_BYTES if name == "bundle" else MAX_FIELD_BYTES
                raw = await _bounded(part, limit, name)
                found[name] = raw if name == "bundle" else raw.decode("ascii", "replace")
    except TimeoutError as exc:
        raise RequestTimeout("the upload did not arrive in time") from exc
    except (HttpProcessingError, web.RequestPayloadError, ConnectionError, ValueError) as exc:
        raise InputError("the upload is not a well-formed form") from exc
    if not found.get("bundle"):
        raise InputError("choose a bundle (.tar.gz, as `broker policy build` writes it)")
    return found


async def _parts(request: web.Request) -> AsyncIterator[tuple[str, BodyPartReader]]:
    """The form's known parts (others are refused), at most ``MAX_PARTS``."""
    reader = await request.multipart()
    for _ in range(MAX_PARTS + 1):
        part = await reader.next()
        if part is None:
            return
        if not isinstance(part, BodyPartReader) or part.name not in ("bundle", *FORM_FIELDS):
            raise InputError("the form has a part it does not ask for")
        yield part.name, part
    raise InputError(f"the form has more than {MAX_PARTS} parts")


async def _bounded(part: BodyPartReader, limit: int, name: str) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while chunk := await part.read_chunk(64 * 1024):
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"{name} is larger than {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _candidate(raw: bytes, settings: PolicySettings) -> tuple[CompiledPolicy, bool]:
    """The candidate unpacked once (the strict tar reader) and every check run on those files:
    its signature verified when it is signed and the broker has a bundle key (an unsigned one,
    or a signed one on a broker without a key, is compared unverified), held to the structure
    rules and compiled by the pinned ``opa``. Blocking (``opa``): a thread.

    Raises:
        PolicyLoadError: it does not read, verify, keep the rules or compile.
        ConfigError: no ``opa`` here.
    """
    files = opa_bundle.unpack(raw, source=CANDIDATE)
    key = settings.bundle_verification_key
    checked = opa_bundle.SIGNATURES in files and key is not None
    verification = None
    if checked:
        verification = opa_bundle.verification_from_file(key, settings.bundle_verification_scope)
    else:  # compared, not trusted: the signature (if any) is set aside
        files = {name: content for name, content in files.items() if name != opa_bundle.SIGNATURES}
    verified = opa_bundle.read_files(files, source=CANDIDATE, verification=verification)
    opa = find_opa(str(settings.opa_binary) if settings.opa_binary else None)
    return load_verified_bundle(verified, source=CANDIDATE, opa=opa), checked


def _compare(
    decisions: DecisionLog, span: Window, compiled: CompiledPolicy, verified: bool
) -> Comparison:
    """The candidate re-deciding the window's decisions, oldest first, until the window ends or
    ``COMPARE_SECONDS`` pass (then ``stopped_at`` says where). Blocking: a thread.

    Raises:
        CandidateFailed: the candidate stopped with a run-time error on a decision.
    """
    replaying = Replay(compiled, failures=logging.DEBUG)  # said by ``compare``, at INFO
    comparison = Comparison(compiled, span, verified)
    deadline = time.monotonic() + COMPARE_SECONDS
    for record in read(decisions, span, DECISION_TYPES):
        if comparison.since is None:
            comparison.since = record.time
        try:
            comparison.changes.extend(replaying.changes(record))
        except EvaluationFailed as exc:
            raise CandidateFailed(record.index, exc.problem) from exc
        except UpstreamError as exc:  # its memory cannot hold the input
            raise CandidateFailed(record.index, exc.message) from exc
        comparison.records += 1
        if time.monotonic() > deadline:
            comparison.stopped_at = record.index
            break
    comparison.summary = dict(replaying.summary)
    return comparison

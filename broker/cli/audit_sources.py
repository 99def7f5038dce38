"""Where ``broker audit monitor`` reads logs: a broker's public audit API, or a log on disk.

A broker URL is ``https://`` (``http://`` only when its host, parsed, is loopback). Every
replica behind it answers for every replica's log, asked for by its origin (``?origin=``).

With an expected identity (``--broker-image``, ``cli/broker_pin.py``), the broker's attestation
is verified before any log request and its certificate pinned for every later one; the key it
serves at ``GET /v1/log/key`` must be the checkpoint key the attestation binds (``Attested``).
Such a source answers for the attested broker's own log only, and a log key followed from it
must be that key.
"""

from __future__ import annotations

import base64
import urllib.error
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote, urlsplit

from broker.audit.identity import read_handovers
from broker.audit.publisher import checkpoint_paths
from broker.audit.segments import log_files
from broker.cli.broker_pin import (
    BrokerConnection,
    attested_log_key,
    connect,
    not_attested_line,
    same_public_key,
)
from broker.client.broker_identity import BrokerIdentity, BrokerNotAttested
from broker.config import is_loopback
from broker.core.errors import ConfigError
from broker.core.jsonsafe import loads_bounded
from broker.crypto.checkpoint import NoteError, NoteVerifier, parse_checkpoint
from broker.crypto.merkle import MerkleTree

MAX_ANSWER_BYTES = 1024 * 1024
ENTRIES_PAGE = 500  # records asked per GET /v1/log/entries (the broker serves at most 1000)
MAX_ENTRIES_BYTES = 64 * 1024 * 1024  # one page's answer
UNBOUND = (
    "the broker's attestation binds no checkpoint key (one held in Cloud KMS): its log key "
    "cannot be checked against it; --accept-unbound-log-key follows it with the --key you pin"
)


class Unreachable(Exception):
    """The log could not be read; nothing was checked."""


class Inconsistent(Exception):
    """The log contradicts what was seen before (or its checkpoint is not genuine)."""


@dataclass(frozen=True)
class Attested:
    """What a verified broker attests of its log: its image, and its log key with the attested
    checkpoint key (both ``None``: the attestation binds none, and the user accepted that)."""

    image_digest: str
    log_key: str | None
    spki: bytes | None

    def holds(self, origin: str) -> bool:
        return self.log_key is None or NoteVerifier.parse(self.log_key).name == origin

    def check(self, origin: str, key: str) -> None:
        """Raises: Inconsistent when ``key`` (the log key followed) is not the attested one."""
        if self.spki is not None and not same_public_key(self.spki, NoteVerifier.parse(key)):
            raise Inconsistent(
                f"broker_not_attested: checkpoint: the key of the log of origin {origin!r} is "
                "not the checkpoint key the broker's attestation binds"
            )

    def report(self) -> dict[str, Any]:
        bound = "attested" if self.spki is not None else "not bound (checked against --key only)"
        return {"image_digest": self.image_digest, "log_key": bound}


class Source(Protocol):
    """A place that holds logs; ``attested``: set for a broker whose attestation verified."""

    attested: Attested | None

    def holds(self, origin: str) -> bool: ...

    def checkpoint(self, origin: str) -> str: ...

    def consistency(self, origin: str, first: int, second: int) -> list[bytes]: ...

    def handovers(self, origin: str) -> list[str]: ...

    def entries(self, origin: str, start: int, end: int) -> Iterable[bytes]:
        """Records from ``start`` (at least one, at most up to ``end``) exactly as stored;
        read as they are iterated (a source may stop short: ask again from there)."""
        ...


class BrokerSource:
    """A broker's public audit API."""

    def __init__(
        self,
        broker: BrokerConnection,
        *,
        accept_unbound: bool,
        headers: dict[str, str] | None = None,
    ) -> None:
        """``headers``: an auditor token's, for the records (``entries``; watch rules).

        Raises: BrokerNotAttested (``checkpoint``) for a log key that is not the attested
        one, or an unbound one not accepted; urllib.error.URLError / OSError: not reached."""
        self._broker = broker
        self._headers = headers or {}
        self.attested: Attested | None = None
        if broker.verified is not None:
            log_key = attested_log_key(broker)
            if log_key is None and not accept_unbound:
                raise BrokerNotAttested("checkpoint", UNBOUND)
            spki = broker.verified.keys.get("checkpoint") if log_key is not None else None
            self.attested = Attested(broker.verified.image_digest, log_key, spki)

    def holds(self, origin: str) -> bool:
        return self.attested is None or self.attested.holds(origin)

    def _get(self, path: str, origin: str, *, limit: int = MAX_ANSWER_BYTES) -> bytes:
        query = ("&" if "?" in path else "?") + "origin=" + quote(origin, safe="")
        try:
            with self._broker.open(path + query, headers=self._headers) as response:
                return bytes(response.read(limit))
        except urllib.error.HTTPError as exc:
            exc.close()
            raise Unreachable(f"GET {path.split('?', 1)[0]}: HTTP {exc.code}") from exc
        except BrokerNotAttested as exc:
            raise Inconsistent(not_attested_line(exc).removeprefix("error: ")) from exc
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            raise Unreachable(f"{self._broker.url} cannot be reached: {exc}") from exc

    def checkpoint(self, origin: str) -> str:
        return self._get("/v1/log/checkpoint", origin).decode("utf-8", "replace")

    def consistency(self, origin: str, first: int, second: int) -> list[bytes]:
        raw = self._get(f"/v1/log/proof/consistency?first={first}&second={second}", origin)
        try:
            return [base64.b64decode(h, validate=True) for h in loads_bounded(raw)["hashes"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise Inconsistent("the consistency proof is malformed") from exc

    def handovers(self, origin: str) -> list[str]:
        try:
            notes = loads_bounded(self._get("/v1/log/key", origin)).get("handovers", [])
        except (ValueError, AttributeError):
            return []
        return [str(note) for note in notes] if isinstance(notes, list) else []

    def entries(self, origin: str, start: int, end: int) -> list[bytes]:
        """``GET /v1/log/entries`` (the auditor role: ``--token-file``), from the replica whose
        log it is (another replica answers 404: give each replica's address).

        Raises:
            Unreachable: not answered, refused, too large, or no record served.
        """
        path = f"/v1/log/entries?start={start}&end={min(end, start + ENTRIES_PAGE)}"
        raw = self._get(path, origin, limit=MAX_ENTRIES_BYTES + 1)
        if len(raw) > MAX_ENTRIES_BYTES:
            raise Unreachable(f"GET /v1/log/entries from {start}: over {MAX_ENTRIES_BYTES} bytes")
        lines = raw.split(b"\n")[:-1]
        if not lines:
            raise Unreachable(f"GET /v1/log/entries served no record from {start}")
        return lines[: end - start]


class LocalLog:
    """A log on this machine: its checkpoint file, and proofs computed from its records."""

    attested: Attested | None = None

    def __init__(self, path: Path) -> None:
        self._path = path

    def holds(self, origin: str) -> bool:
        try:
            note = self.checkpoint(origin)
            return parse_checkpoint(note[: note.find("\n\n") + 1]).origin == origin
        except (Unreachable, NoteError):
            return True  # tried, so that what is wrong with it is said

    def checkpoint(self, origin: str) -> str:
        try:
            return checkpoint_paths(self._path)[0].read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise Unreachable(f"no checkpoint beside {self._path}: {exc}") from exc

    def consistency(self, origin: str, first: int, second: int) -> list[bytes]:
        try:
            data = b"".join(p.read_bytes() for p in log_files(self._path) if p.exists())
        except OSError as exc:
            raise Unreachable(f"{self._path}: {exc.strerror}") from exc
        lines = data.split(b"\n")[:-1]
        if len(lines) < second:
            raise Inconsistent(f"the log holds {len(lines)} records, its checkpoint {second}")
        tree = MerkleTree.from_lines(lines[:second])
        return tree.consistency_proof(first, second)

    def handovers(self, origin: str) -> list[str]:
        return read_handovers(self._path)

    def entries(self, origin: str, start: int, end: int) -> Iterator[bytes]:
        """Records ``[start, end)`` read from the log's files (every segment, in order), one
        at a time as they are iterated: a large log is never held in memory.

        Raises (while iterated):
            Unreachable: a file cannot be read, or holds fewer records.
        """
        index = start
        for line in self._lines(start, end):
            yield line
            index += 1
        if index < end:
            raise Unreachable(f"{self._path} holds {index} records, its checkpoint {end}")

    def _lines(self, start: int, end: int) -> Iterator[bytes]:
        """The complete lines ``[start, end)`` of the log's files (fewer if they end first)."""
        index = 0
        try:
            for path in log_files(self._path):
                if not path.exists():
                    continue
                with path.open("rb") as handle:
                    for line in handle:
                        if index >= end or not line.endswith(b"\n"):  # a torn line ends it
                            return
                        if index >= start:
                            yield line[:-1]
                        index += 1
        except OSError as exc:
            raise Unreachable(f"{self._path}: {exc.strerror}") from exc


def check_url(text: str) -> None:
    """A broker URL: ``https://``, or ``http://`` only when its host is loopback, parsed as a
    URL (``http://127.0.0.1@evil.example/`` and ``http://127.0.0.1.evil.example/`` are remote).

    Raises:
        ConfigError: any other URL.
    """
    try:
        parts = urlsplit(text)
        host = parts.hostname or ""
        parts.port  # noqa: B018 - a malformed port raises here, not at the first request
    except ValueError as exc:
        raise ConfigError("URL-or-LOG", f"not a URL: {exc}") from exc
    plain_loopback = parts.scheme == "http" and is_loopback(host)
    if parts.username is not None or parts.password is not None or not host:
        raise ConfigError("URL-or-LOG", "a broker URL has a host and no user name or password")
    if parts.scheme != "https" and not plain_loopback:
        raise ConfigError("URL-or-LOG", "a broker URL is https:// (http:// only on loopback)")


def open_source(
    text: str,
    *,
    ca: Path | None,
    timeout: float,
    identity: BrokerIdentity | None,
    accept_unbound: bool,
    headers: dict[str, str] | None = None,
) -> Source:
    """A broker URL (with ``identity``: attested first), or a log file.

    Raises:
        ConfigError: a URL ``check_url`` refuses.
        BrokerNotAttested: the broker's attestation or its log key failed a check.
        BrokerUnreachable, urllib.error.URLError, OSError: an attested broker was not reached.
    """
    if "://" not in text:
        return LocalLog(Path(text))
    check_url(text)
    return BrokerSource(
        connect(text, identity, ca=ca, timeout=timeout),
        accept_unbound=accept_unbound,
        headers=headers,
    )

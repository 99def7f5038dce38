"""One policy per broker across its worker processes (``broker serve --workers N``).

The workers of one replica share a directory beside its log, ``<log>.workers/``:

* ``request.json`` — the newest reload request, ``{"generation", "trigger", "who",
  "allow_downgrade", "to_version", "bundle_sha256", "reason"}``, written under ``request.lock``
  (an admin downgrade names its target, so every worker loads that bundle or refuses);
* ``worker-<index>.json`` — each worker's report, rewritten atomically whenever its policy is
  (re)loaded: ``{"index", "pid", "generation", "digest", "ok", "problem", "time"}``.

A reload through the admin API, in whichever worker receives it: bump the generation (with the
admin's trigger and who), send SIGHUP to the supervisor, which forwards it to every worker (this
one included), and wait until every worker reports that generation. The answer then names the one
digest they all serve, or the workers that refused the policy or did not answer: no release is
decided by the old digest after a 200. A plain SIGHUP (``systemctl reload``) reaches every worker
the same way; polling reloads each worker on its own, within one interval. A worker that
(re)starts loads the policy from its source and reports before it serves.

Every worker appends its ``policy_change`` through the log's conditional append, so one change is
one record per replica, whichever worker writes it first.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import signal
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from broker.policy.freshness import DowngradeTarget

CONFIRM_TIMEOUT_SECONDS = 60.0
POLL_SECONDS = 0.05


@dataclass(frozen=True)
class ReloadRequest:
    generation: int
    trigger: str
    who: str
    allow_downgrade: bool = False  # an admin's deliberate downgrade (with its reason)
    reason: str | None = None
    to_version: int | None = None  # the downgrade's target version (required with it)
    bundle_sha256: str | None = None  # and, optionally, the target bundle's bytes

    @property
    def downgrade(self) -> DowngradeTarget | None:
        """The admin downgrade this request asks for (``None``: none, or no target named)."""
        if not self.allow_downgrade or self.to_version is None:
            return None
        return DowngradeTarget(self.to_version, self.bundle_sha256)


@dataclass(frozen=True)
class WorkerReport:
    index: int
    pid: int
    generation: int
    digest: str
    ok: bool
    problem: str | None

    def describe(self) -> dict[str, Any]:
        return {
            "worker": self.index,
            "digest": self.digest,
            "ok": self.ok,
            **({"problem": self.problem} if self.problem else {}),
        }


@dataclass(frozen=True)
class WorkerGroup:
    """This process's place among the workers of one replica.

    ``count`` is 1 for a single process (``broker serve`` without workers): then a reload is
    local and confirmed by this process alone.
    """

    directory: Path
    index: int
    count: int
    supervisor_pid: int | None  # None: no supervisor (a single process)

    @classmethod
    def for_log(cls, log: Path, environ: Mapping[str, str]) -> WorkerGroup:
        """From the supervisor's environment (``BROKER_WORKER_INDEX``, ``BROKER_WORKER_COUNT``);
        without it, a group of one."""
        directory = log.with_name(log.name + ".workers")
        count = int(environ.get("BROKER_WORKER_COUNT", "1") or 1)
        if count <= 1 or "BROKER_WORKER_INDEX" not in environ:
            return cls(directory, 0, 1, None)
        return cls(directory, int(environ["BROKER_WORKER_INDEX"]), count, os.getppid())

    # --- requests ------------------------------------------------------------------------------

    def request(
        self,
        trigger: str,
        who: str,
        *,
        downgrade: DowngradeTarget | None = None,
        reason: str | None = None,
    ) -> int:
        """Record a reload request (``downgrade``: an admin downgrade's target); its
        generation."""
        with self._locked():
            current = self.read_request()
            generation = current.generation + 1
            _write_json(
                self.directory / "request.json",
                {
                    "generation": generation,
                    "trigger": trigger,
                    "who": who,
                    "allow_downgrade": downgrade is not None,
                    "to_version": None if downgrade is None else downgrade.version,
                    "bundle_sha256": None if downgrade is None else downgrade.bundle_sha256,
                    "reason": reason,
                },
            )
        return generation

    def read_request(self) -> ReloadRequest:
        value = _read_json(self.directory / "request.json") or {}
        return ReloadRequest(
            generation=int(value.get("generation", 0)),
            trigger=str(value.get("trigger", "sighup")),
            who=str(value.get("who", "signal:SIGHUP")),
            allow_downgrade=value.get("allow_downgrade") is True,
            reason=str(value["reason"]) if value.get("reason") is not None else None,
            to_version=_positive(value.get("to_version")),
            bundle_sha256=_text(value.get("bundle_sha256")),
        )

    def signal_all(self) -> None:
        """SIGHUP to the supervisor, which forwards it to every worker (this one included)."""
        if self.supervisor_pid is not None:
            os.kill(self.supervisor_pid, signal.SIGHUP)

    # --- serving -------------------------------------------------------------------------------

    def mark_serving(self) -> None:
        """This worker accepts connections now (the supervisor says "serving" once all do)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        _write_json(self.directory / f"serving-{self.index}.json", {"pid": os.getpid()})

    def clear_serving(self) -> None:
        for marker in self.directory.glob("serving-*.json"):
            marker.unlink(missing_ok=True)

    def serving_pid(self, index: int) -> int | None:
        value = _read_json(self.directory / f"serving-{index}.json")
        return None if value is None else int(value.get("pid", 0))

    # --- reports -------------------------------------------------------------------------------

    def report(self, *, generation: int, digest: str, ok: bool, problem: str | None = None) -> None:
        """Publish this worker's policy to the others (nothing to do for a single process)."""
        if self.supervisor_pid is None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        _write_json(
            self.directory / f"worker-{self.index}.json",
            {
                "index": self.index,
                "pid": os.getpid(),
                "generation": generation,
                "digest": digest,
                "ok": ok,
                "problem": problem,
                "time": time.time(),
            },
        )

    def reports(self) -> list[WorkerReport | None]:
        """Each worker's report (``None``: none yet, or its process is gone)."""
        found: list[WorkerReport | None] = []
        for index in range(self.count):
            value = _read_json(self.directory / f"worker-{index}.json")
            if value is None or not _alive(int(value.get("pid", 0))):
                found.append(None)
                continue
            found.append(
                WorkerReport(
                    index=index,
                    pid=int(value["pid"]),
                    generation=int(value.get("generation", 0)),
                    digest=str(value.get("digest", "")),
                    ok=bool(value.get("ok")),
                    problem=value.get("problem"),
                )
            )
        return found

    async def confirmed(self, generation: int) -> tuple[list[WorkerReport], list[int]]:
        """Wait until every worker reports ``generation`` (or later), at most
        ``CONFIRM_TIMEOUT_SECONDS``; (reports, silent workers)."""
        deadline = asyncio.get_running_loop().time() + CONFIRM_TIMEOUT_SECONDS
        while True:
            reports = await asyncio.to_thread(self.reports)
            done = [r for r in reports if r is not None and r.generation >= generation]
            silent = [i for i, r in enumerate(reports) if r is None or r.generation < generation]
            if not silent or asyncio.get_running_loop().time() >= deadline:
                return done, silent
            await asyncio.sleep(POLL_SECONDS)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.directory / "request.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


def _positive(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _write_json(path: Path, value: Mapping[str, Any]) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(value), encoding="utf-8")
    os.replace(temporary, path)

"""``broker serve`` with ``[server] workers = N``: N worker processes on one port, one supervisor.

Each worker is an ordinary ``broker serve`` process (its own event loop, app, caches and
connections) that binds the listen address with ``SO_REUSEPORT``; the kernel spreads new
connections over the workers' listening sockets. The supervisor:

* binds the address first (without listening) so that ``:0`` resolves to one port for all and
  the port stays reserved while a worker restarts;
* hands every worker the resolved address and the resolved nonce store through the environment
  (``BROKER_SERVER_LISTEN``, ``BROKER_NONCES_STORE``; a worker never picks a per-process store);
* restarts a worker that exits, with a back-off that grows while it keeps dying young
  (1 s, 2 s, … at most 30 s) and resets once it has run for a minute;
* forwards SIGHUP (policy reload, TLS certificate) to every worker; a worker that receives an
  admin reload sends SIGHUP here and waits until every worker reports the new policy
  (``policy/workers.py``). A worker gets SIGHUP only once it says it serves (it installs its
  handler first): SIGHUP's default action would kill a worker still starting, so one that
  arrives meanwhile is held and sent when the worker is up;
* on SIGTERM or SIGINT stops restarting, sends SIGTERM to every worker (each drains its
  connections and closes its stores), waits ``STOP_GRACE_SECONDS``, then SIGKILLs stragglers.

One supervisor per broker, and no worker outlives it (an orphan would serve a policy no reload
reaches). The supervisor holds an exclusive ``flock`` on ``<log>.supervisor.lock`` and refuses to
start when that lock is taken or when something already accepts connections on its (non-zero)
listen port. A worker is started with no command-line flag at all (a flag one letter from
``--workers`` was reachable by a typo): the supervisor hands it the read end of a pipe whose write
end only the supervisor holds (``BROKER_SUPERVISOR_FD``). The worker asks the kernel for SIGTERM
when its parent dies (``PR_SET_PDEATHSIG``), checks that its parent is still the supervisor that
started it (the parent may have died before that request), and also stops when the pipe reads
end-of-file, so even a ``kill -9`` of the supervisor leaves no worker serving.

Shared state lives where every worker sees it: nonces in the configured shared store (SQLite on
this host by default), keys in the key store, decisions in the one log file (writers take turns
under ``flock``; the chain and the tree stay intact, docs/audit.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import logging
import os
import signal
import socket
import stat
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.multiprocess import mark_process_dead

from broker.config import Settings, nonce_store_setting, split_listen
from broker.core.errors import ConfigError
from broker.core.metrics import MULTIPROCESS_ENV
from broker.policy.workers import WorkerGroup

log = logging.getLogger(__name__)
STOP_GRACE_SECONDS = 30.0
MAX_BACKOFF_SECONDS = 30.0
HEALTHY_AFTER_SECONDS = 60.0
SERVING_TIMEOUT_SECONDS = 120.0  # start-up compiles the policy and opens every store
# A worker is a ``broker serve`` started by a supervisor with these set (never a CLI flag).
SUPERVISOR_FD_ENV = "BROKER_SUPERVISOR_FD"  # the read end of the supervisor's life pipe
SUPERVISOR_PID_ENV = "BROKER_SUPERVISOR_PID"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PROBE_TIMEOUT_SECONDS = 1.0


@dataclass
class Worker:
    index: int
    process: asyncio.subprocess.Process | None = None
    started: float = 0.0
    failures: int = 0  # consecutive early exits
    waiter: asyncio.Task[int] | None = field(default=None, repr=False)
    serving: bool = False  # its SIGHUP handler is installed (it marked itself serving)
    owed_sighup: bool = False  # a SIGHUP arrived while it was starting


def reserve_port(host: str, port: int) -> socket.socket:
    """Bind (not listen) the address with SO_REUSEPORT: the port every worker then binds too."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


@contextlib.contextmanager
def supervisor_lock(log_path: Path) -> Iterator[None]:
    """Hold ``<log>.supervisor.lock`` exclusively for as long as this supervisor runs.

    Raises:
        ConfigError: another supervisor holds it (its pid in the message).
    """
    path = log_path.with_name(log_path.name + ".supervisor.lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
            raise ConfigError(
                "server.workers",
                f"another broker supervisor (pid {holder}) already serves the log {log_path}; "
                "stop it first (SIGTERM) or give this broker its own [audit] log",
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def refuse_served_address(host: str, port: int) -> None:
    """Refuse to share a port with a server that already accepts connections on it: with
    SO_REUSEPORT the kernel would split connections between that server and ours.

    Raises:
        ConfigError: something accepts connections on ``host:port``.
    """
    if port == 0:
        return
    probe = "127.0.0.1" if host in ("", "0.0.0.0") else ("::1" if host == "::" else host)  # noqa: S104
    try:
        with socket.create_connection((probe, port), timeout=PROBE_TIMEOUT_SECONDS):
            pass
    except OSError:
        return
    raise ConfigError(
        "server.listen",
        f"{host}:{port} is already served (another broker?); stop it or choose another port",
    )


def worker_pipe_fd(environ: Mapping[str, str]) -> int | None:
    """The supervisor's life pipe when this process is one of its workers, else ``None``.

    Raises:
        ConfigError: the variables are set but do not name this process's supervisor and a pipe.
    """
    value = environ.get(SUPERVISOR_FD_ENV)
    if value is None:
        return None
    try:
        fd, supervisor = int(value), int(environ.get(SUPERVISOR_PID_ENV, ""))
        is_pipe = stat.S_ISFIFO(os.fstat(fd).st_mode)
    except (ValueError, OSError):
        is_pipe, supervisor = False, -1
    if not is_pipe:
        raise ConfigError(SUPERVISOR_FD_ENV, "is set only by `broker serve --workers N`")
    _die_with_parent()
    if os.getppid() != supervisor:  # the supervisor died before the request above took effect
        raise ConfigError(SUPERVISOR_FD_ENV, "the supervisor that started this worker is gone")
    return fd


def _die_with_parent() -> None:
    """Ask Linux for SIGTERM when the parent (the supervisor) dies, however it dies."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


class Supervisor:
    def __init__(self, settings: Settings, config: Path) -> None:
        self._settings = settings
        self._config = config
        self._workers = [Worker(index) for index in range(settings.server.workers)]
        self._stopping = asyncio.Event()
        self._listen = ""
        log_path = settings.audit.log
        self._metrics_dir = log_path.with_name(log_path.name + ".metrics")
        self._group = WorkerGroup.for_log(log_path, {})
        self._read_end = self._life_pipe = -1  # the life pipe, while run() runs

    async def run(self) -> int:
        """Run the workers until SIGTERM or SIGINT.

        Raises:
            ConfigError: another supervisor serves this log, or the port is already served.
        """
        with supervisor_lock(self._settings.audit.log):
            host, port = split_listen(self._settings.server.listen)
            refuse_served_address(host, port)
            self._prepare_metrics_directory()
            read_end, self._life_pipe = os.pipe()  # the write end never leaves this process
            self._read_end = read_end
            try:
                return await self._serve(host, port)
            finally:
                os.close(read_end)
                os.close(self._life_pipe)

    async def _serve(self, host: str, port: int) -> int:
        reserved = reserve_port(host, port)
        try:
            bound_port = reserved.getsockname()[1]
            self._listen = f"[{host}]:{bound_port}" if ":" in host else f"{host}:{bound_port}"
            loop = asyncio.get_running_loop()
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(signum, self._stopping.set)
            loop.add_signal_handler(signal.SIGHUP, self._forward, signal.SIGHUP)
            await asyncio.to_thread(self._group.clear_serving)
            for worker in self._workers:
                await self._start(worker)
            announcer = asyncio.create_task(self._until_serving())
            tracker = asyncio.create_task(self._track_serving())
            try:
                await self._watch()
            finally:
                announcer.cancel()
                tracker.cancel()
        finally:
            await self._stop_all()
            reserved.close()
        return 0

    async def _until_serving(self) -> None:
        """Say "serving" only once every worker accepts connections (each marks itself after
        its socket listens); name a worker that exits first, with its exit code (its own error
        is on this stderr just above)."""
        deadline = time.monotonic() + SERVING_TIMEOUT_SECONDS
        reported: set[int] = set()  # processes whose early exit was named
        warned = False
        while not self._stopping.is_set():
            waiting = []
            for worker in self._workers:
                pid = worker.process.pid if worker.process is not None else None
                waiter = worker.waiter
                if waiter is not None and waiter.done() and pid is not None and pid not in reported:
                    reported.add(pid)  # _watch restarts it, with back-off
                    print(
                        f"broker supervisor: worker {worker.index} exited with "
                        f"{waiter.result()} before serving (its error is above)",
                        file=sys.stderr,
                        flush=True,
                    )
                if await asyncio.to_thread(self._group.serving_pid, worker.index) != pid:
                    waiting.append(worker.index)
            if not waiting:
                print(
                    f"broker supervisor: {len(self._workers)} workers serving on {self._listen}",
                    file=sys.stderr,
                    flush=True,
                )
                return
            if time.monotonic() > deadline and not warned:
                warned = True  # keep waiting: a restarted worker may still come up
                log.warning(
                    "workers %s are not serving after %.0f s", waiting, SERVING_TIMEOUT_SECONDS
                )
            await asyncio.sleep(0.05)

    async def _track_serving(self) -> None:
        """Note each worker (and each restart) once it serves; hand it a SIGHUP held for it."""
        while True:
            for worker in self._workers:
                process = worker.process
                if process is None or worker.serving or process.returncode is not None:
                    continue
                if await asyncio.to_thread(self._group.serving_pid, worker.index) == process.pid:
                    worker.serving = True
                    if worker.owed_sighup:
                        worker.owed_sighup = False
                        process.send_signal(signal.SIGHUP)
            await asyncio.sleep(0.05)

    async def _start(self, worker: Worker) -> None:
        env = {
            **os.environ,
            "BROKER_SERVER_LISTEN": self._listen,
            "BROKER_SERVER_WORKERS": "1",
            "BROKER_NONCES_STORE": nonce_store_setting(self._settings.nonces.store),
            "BROKER_WORKER_INDEX": str(worker.index),
            "BROKER_WORKER_COUNT": str(len(self._workers)),  # a reload waits for every worker
            MULTIPROCESS_ENV: str(self._metrics_dir),  # one /metrics for all workers
            SUPERVISOR_FD_ENV: str(self._read_end),
            SUPERVISOR_PID_ENV: str(os.getpid()),
        }
        worker.process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "broker.cli",
            "serve",
            "--config",
            str(self._config),
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            pass_fds=(self._read_end,),
        )
        worker.started = time.monotonic()
        worker.serving = False
        worker.waiter = asyncio.create_task(worker.process.wait())

    async def _watch(self) -> None:
        stop = asyncio.create_task(self._stopping.wait())
        try:
            while not self._stopping.is_set():
                waiters = {w.waiter for w in self._workers if w.waiter is not None}
                done, _ = await asyncio.wait({stop, *waiters}, return_when=asyncio.FIRST_COMPLETED)
                dead = [w for w in self._workers if w.waiter is not None and w.waiter in done]
                if dead and not self._stopping.is_set():
                    await asyncio.gather(*(self._restart(w, w.waiter.result()) for w in dead))  # type: ignore[union-attr]
        finally:
            stop.cancel()

    async def _restart(self, worker: Worker, code: int) -> None:
        lived = time.monotonic() - worker.started
        worker.failures = 0 if lived >= HEALTHY_AFTER_SECONDS else worker.failures + 1
        delay = min(MAX_BACKOFF_SECONDS, float(2 ** max(worker.failures - 1, 0)))
        log.warning(  # on stderr: `broker` logs WARNING and above there
            "worker %d exited with %d after %.1f s; restarting in %.0f s",
            worker.index,
            code,
            lived,
            delay,
        )
        worker.waiter = None
        if worker.process is not None:  # its live gauges stop counting; counters stay summed
            mark_process_dead(worker.process.pid, str(self._metrics_dir))  # type: ignore[no-untyped-call]
        try:
            await asyncio.wait_for(self._stopping.wait(), timeout=delay)
        except TimeoutError:
            await self._start(worker)

    def _prepare_metrics_directory(self) -> None:
        """An empty ``<log>.metrics/``: values of an earlier run must not add to this one's."""
        self._metrics_dir.mkdir(parents=True, exist_ok=True)
        for stale in self._metrics_dir.glob("*.db"):
            stale.unlink()

    def _forward(self, signum: int) -> None:
        for worker in self._workers:
            if worker.process is not None and worker.process.returncode is None:
                if signum == signal.SIGHUP and not worker.serving:
                    worker.owed_sighup = True  # sent once it serves (_track_serving)
                    continue
                worker.process.send_signal(signum)

    async def _stop_all(self) -> None:
        self._forward(signal.SIGTERM)
        running = [w.waiter for w in self._workers if w.waiter is not None and not w.waiter.done()]
        if not running:
            return
        _, late = await asyncio.wait(running, timeout=STOP_GRACE_SECONDS)
        if late:
            self._forward(signal.SIGKILL)
            await asyncio.wait(late)

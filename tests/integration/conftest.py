"""A real broker on 127.0.0.1 (TLS, SQLite, local KEK, the Wasm policy engine, decision log)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest
from aiohttp import web
from blockbuster import BlockBuster, blockbuster_ctx
from cryptography.hazmat.primitives.asymmetric import ec

from broker.api.server import BrokerRunner
from broker.app import create_app, server_ssl_context
from broker.client import BrokerClient
from broker.config import Settings, load_settings
from broker.dev.issuer import DevIssuer, DevTokenSource, Workload
from broker.dev.workspace import private_pem, write_dev_workspace
from broker.keys.factory import open_key_service
from broker.keys.kek.pkcs11 import create_pkcs11_kek, parse_pkcs11_uri
from broker.keys.store.base import Purpose
from broker.policy import manager as policy_manager
from broker.policy.build import compile_policy_dir
from tests.fakes.google_kms import FakeKms
from tests.fakes.google_secretmanager import FakeSecretManager
from tests.support import cli as cli_support
from tests.support.constants import ALLOWED, AUDIENCE, GPU_KEY, KEY, QUERY_KEY
from tests.support.issuers import dev_issuer
from tests.support.policies import cached
from tests.support.processes import free_port, wait_ready, wait_until


@pytest.fixture(scope="session", autouse=True)
def shared_policy_compiles() -> Iterator[None]:
    """Brokers of this test process share compiled policies of identical directories
    (``tests/support/policies.py``); the first of each is compiled by OPA as ever."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(policy_manager, "compile_policy_dir", cached(compile_policy_dir))
        yield


@pytest.fixture(scope="session", autouse=True)
def store_timeouts_for_a_loaded_machine() -> Iterator[None]:
    """Brokers started by tests (in process or as subprocesses, which inherit this) wait up to
    10 s for the nonce store instead of the product's 2 s: on a CI machine whose two cores are
    busy, a PostgreSQL or Redis answer can take longer than 2 s, and a test then failed with
    "the nonce store did not answer" (issue 28, item 11). Tests of a store that does not answer
    set their own, shorter, time-out."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BROKER_NONCES_TIMEOUT_SECONDS", "10")
        yield


@pytest.fixture(autouse=True)
def blockbuster() -> Iterator[BlockBuster]:
    """Fail any test in which the event loop makes a blocking call."""
    with blockbuster_ctx("broker") as detector:
        # Start-up only: a google-cloud client constructor (run once when a KMS KEK or a Secret
        # Manager store opens, never on a request) checks whether mTLS config files exist.
        for module, functions in GOOGLE_CLIENT_STARTUP_CHECKS:
            for name in ("os.stat", "os.path.exists", "os.path.isfile", "os.path.abspath"):
                if name in detector.functions:
                    detector.functions[name].can_block_in(module, functions)
        # grpc's AioChannel/AioServer deallocators join a thread, from Cython (no Python frame
        # to allow it in), whenever the garbage collector frees one on the loop thread: a
        # shutdown-time wait, not a request-path block. Lock waits are therefore not reported.
        for name in ("threading.Lock.acquire", "threading.Lock.acquire_lock"):
            detector.functions[name].deactivate()
        cli_support.DETECTORS.append(detector)
        try:
            yield detector
        finally:
            cli_support.DETECTORS.remove(detector)


GOOGLE_CLIENT_STARTUP_CHECKS = (
    (
        "google/auth/transport/_mtls_helper.py",
        ("_get_cert_config_path", "_check_config_path", "_should_use_gke_credential_bundle"),
    ),
    ("google/auth/_agent_identity_utils.py", ("_is_certificate_file_ready",)),
    # asyncpg looks for ~/.pgpass and ~/.postgresql TLS files when it opens a connection; the
    # PostgreSQL nonce store opens its pool once and keeps the connections (nonce_stores.py).
    (
        "asyncpg/connect_utils.py",
        ("_read_password_file", "_dot_postgresql_path", "_parse_connect_dsn_and_args"),
    ),
)


@dataclass
class RunningBroker:
    url: str
    settings: Settings
    issuer: DevIssuer
    client_tls: ssl.SSLContext
    workdir: Path
    first_record: int = 0  # records() starts here: a shared broker shows each test its own
    clock: Callable[[], datetime] | None = None  # the broker's clock, when a test fixed it

    def client(self) -> BrokerClient:
        return BrokerClient(self.url, ssl_context=self.client_tls)

    def token_source(self, digest: str = ALLOWED, **workload: Any) -> DevTokenSource:
        clock = self.clock or (lambda: datetime.now(UTC))
        return DevTokenSource(self.issuer, Workload(image_digest=digest, **workload), clock)

    def records(self) -> list[dict[str, Any]]:
        lines = self.settings.audit.log.read_text().splitlines()
        return [json.loads(line) for line in lines[self.first_record :]]

    def from_now_on(self) -> RunningBroker:
        """This broker, its ``records()`` starting after the records written so far."""
        size = len(self.settings.audit.log.read_text().splitlines())
        return dataclasses.replace(self, first_record=size)


def serve_workers(
    config: Path, environ: dict[str, str], client_tls: ssl.SSLContext, *, log: Path | None = None
) -> tuple[subprocess.Popen[bytes], int]:
    """``broker serve --workers 2`` (``BROKER_SERVER_WORKERS``) on a free port, once ready;
    with ``log``, ``broker -v serve`` writing its output (INFO and up) to that file."""
    port = free_port()
    verbose = ["-v"] if log is not None else []
    command = [sys.executable, "-m", "broker.cli", *verbose, "serve", "--config", str(config)]
    urls = public_urls(load_settings(config, environ), f"https://127.0.0.1:{port}")
    with log.open("ab") if log is not None else contextlib.nullcontext() as output:
        process = subprocess.Popen(
            command,
            env={
                **os.environ,
                **environ,
                "BROKER_SERVER_LISTEN": f"127.0.0.1:{port}",
                "BROKER_SERVER_PUBLIC_URLS": ",".join(urls),
            },
            stdout=output or subprocess.DEVNULL,
            stderr=subprocess.STDOUT if output else subprocess.DEVNULL,
        )
    try:
        wait_ready(port, client_tls)
    except BaseException:  # never leave a broker running behind a failed start
        process.kill()
        process.wait(30)
        raise
    return process, port


def public_urls(settings: Settings, served: str) -> tuple[str, ...]:
    """The URLs a test broker is reached at: its configured ones (by default its audience), and
    the loopback URL the tests address it by (DPoP proofs name that one)."""
    return (*settings.server.public_base_urls, served)


def with_public_url(settings: Settings, served: str) -> Settings:
    server = dataclasses.replace(settings.server, public_urls=public_urls(settings, served))
    return dataclasses.replace(settings, server=server)


async def create_test_keys(settings: Settings) -> None:
    async with open_key_service(settings.keys, create_missing_kek=True) as keys:
        await keys.create(KEY, Purpose.MODEL_WEIGHTS, now=datetime.now(UTC))
        await keys.create(GPU_KEY, Purpose.MODEL_WEIGHTS, now=datetime.now(UTC))


@pytest.fixture(scope="module")
def module_workers_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningBroker]:
    """One ``broker serve --workers 2`` for a module's tests (the default workspace). Three
    processes start once instead of per test; each test sees its own records
    (``from_now_on``)."""
    workdir = tmp_path_factory.mktemp("workers") / "broker"
    issuer = dev_issuer()
    config = write_config(workdir, issuer)
    environ = {"BROKER_SERVER_WORKERS": "2"}
    settings = load_settings(config, environ)
    asyncio.run(create_test_keys(settings))
    client_tls = ssl.create_default_context(cafile=str(workdir / "tls" / "ca.pem"))
    process, port = serve_workers(config, environ, client_tls)
    try:
        yield RunningBroker(
            url=f"https://127.0.0.1:{port}",
            settings=settings,
            issuer=issuer,
            client_tls=client_tls,
            workdir=workdir,
        )
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)


def write_config(
    workdir: Path,
    issuer: DevIssuer,
    *,
    jwks_url: str | None = None,
    extra_toml: str = "",
    gpu_keys: dict[str, object] | None = None,
    **server: object,
) -> Path:
    return write_dev_workspace(
        workdir,
        issuer,
        audience=AUDIENCE,
        images={KEY: [ALLOWED], GPU_KEY: [ALLOWED], QUERY_KEY: [ALLOWED]},
        now=datetime.now(UTC),
        gpu_keys=gpu_keys,
        jwks_url=jwks_url,
        # The suite sends bursts from 127.0.0.1 on purpose; the rate-limit tests set their own.
        server_extra={"rate_limit_per_ip": 0, "readyz_rate_per_ip": 0, **server},
        extra_toml=extra_toml,
    )


def write_statement_key(path: Path) -> Path:
    """An EC P-256 PEM for ``[keys] signing_key`` (query-key statements)."""
    path.write_bytes(private_pem(ec.generate_private_key(ec.SECP256R1())))
    return path


@pytest.fixture
def deployment(request: pytest.FixtureRequest) -> str:
    """How ``start_broker`` runs the broker: ``process`` (in this test process, the default) or
    ``workers`` (``broker serve --workers 2``, as deployed). A module runs in both shapes with
    ``pytest.mark.parametrize("deployment", ["process", "workers"], indirect=True)``."""
    return str(getattr(request, "param", "process"))


@pytest.fixture
async def start_broker(tmp_path: Path, deployment: str) -> AsyncIterator[Callable[..., object]]:
    runners: list[web.AppRunner] = []
    processes: list[subprocess.Popen[bytes]] = []

    async def start(
        environ: dict[str, str] | None = None,
        jwks_url: str | None = None,
        extra_toml: str = "",
        gpu_keys: dict[str, object] | None = None,
        workdir_setup: Callable[[Path], None] | None = None,
        reuse: tuple[Path, DevIssuer] | None = None,
        clock: Callable[[], datetime] | None = None,
        handler_cancellation: bool = False,
        **server: object,
    ) -> RunningBroker:
        """Start a broker; ``reuse`` serves an existing config (and its issuer) as it is.
        In this process only: ``clock`` fixes the broker's clock (and its token sources');
        ``handler_cancellation`` cancels a handler whose client hung up (aiohttp's option)."""
        started = len(runners) + len(processes)
        if reuse is None:
            workdir = tmp_path / f"broker{started}"
            issuer = dev_issuer()
            config = await asyncio.to_thread(
                write_config,
                workdir,
                issuer,
                jwks_url=jwks_url,
                extra_toml=extra_toml,
                gpu_keys=gpu_keys,
                **server,
            )
        else:
            config, issuer = reuse
            workdir = config.parent
        if workdir_setup is not None:
            await asyncio.to_thread(workdir_setup, workdir)
        environ = dict(environ or {})
        if deployment == "workers":
            environ["BROKER_SERVER_WORKERS"] = "2"
        settings = await asyncio.to_thread(load_settings, config, environ)
        if reuse is None:
            await create_test_keys(settings)
        client_tls = ssl.create_default_context(cafile=str(workdir / "tls" / "ca.pem"))
        if deployment == "workers":
            process, port = await asyncio.to_thread(serve_workers, config, environ, client_tls)
            processes.append(process)
        else:
            listening = socket.socket()  # bound first: its URL is one of the public URLs
            listening.bind(("127.0.0.1", 0))
            port = listening.getsockname()[1]
            served = with_public_url(settings, f"https://127.0.0.1:{port}")
            app = create_app(served) if clock is None else create_app(served, clock=clock)
            runner = BrokerRunner(app, served.server, handler_cancellation=handler_cancellation)
            try:
                await runner.setup()
            except BaseException:  # start-up refused: the socket is not the site's to close
                listening.close()
                raise
            runners.append(runner)
            site = web.SockSite(runner, listening, ssl_context=server_ssl_context(settings))
            await site.start()
        return RunningBroker(
            url=f"https://127.0.0.1:{port}",
            settings=settings,
            issuer=issuer,
            client_tls=client_tls,
            workdir=workdir,
            clock=clock,
        )

    yield start
    for runner in runners:
        await runner.cleanup()
    for process in processes:
        process.send_signal(signal.SIGTERM)
        await asyncio.to_thread(process.wait, 60)


@pytest.fixture
async def broker(start_broker: Callable[..., object]) -> RunningBroker:
    return await start_broker()  # type: ignore[no-any-return, misc]


# --- key custody: SoftHSM2, Cloud KMS and Secret Manager test servers -------------------------

SOFTHSM_MODULE = Path("/usr/lib/softhsm/libsofthsm2.so")
HSM_PIN = "4711-test-pin"
KMS_KEY = "projects/broker-test/locations/global/keyRings/broker/cryptoKeys/kek"


@pytest.fixture(scope="session")
def softhsm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A SoftHSM2 token with a non-extractable AES-256 KEK; yields its PKCS#11 URI."""
    assert SOFTHSM_MODULE.exists(), "SoftHSM2 is missing: `make test` installs package softhsm2"
    root = tmp_path_factory.mktemp("softhsm")
    (root / "tokens").mkdir()
    conf = root / "softhsm2.conf"
    conf.write_text(f"directories.tokendir = {root / 'tokens'}\nobjectstore.backend = file\n")
    previous = os.environ.get("SOFTHSM2_CONF")
    os.environ["SOFTHSM2_CONF"] = str(conf)  # subprocesses (broker CLI) inherit it
    subprocess.run(
        [
            "softhsm2-util",
            "--init-token",
            "--free",
            "--label",
            "broker",
            "--pin",
            HSM_PIN,
            "--so-pin",
            "so-" + HSM_PIN,
        ],
        check=True,
        capture_output=True,
    )
    (root / "pin").write_text(HSM_PIN)
    uri = (
        f"pkcs11:token=broker;object=kek?module-path={SOFTHSM_MODULE}"
        f"&pin-source=file:{root / 'pin'}"
    )
    create_pkcs11_kek(parse_pkcs11_uri(uri))
    yield uri
    if previous is None:
        os.environ.pop("SOFTHSM2_CONF", None)
    else:
        os.environ["SOFTHSM2_CONF"] = previous


@pytest.fixture
async def fake_kms() -> AsyncIterator[FakeKms]:
    kms = FakeKms()
    kms.create_key(KMS_KEY)
    await kms.start()
    yield kms
    await kms.stop()


@pytest.fixture
async def fake_secretmanager() -> AsyncIterator[FakeSecretManager]:
    manager = FakeSecretManager()
    await manager.start()
    yield manager
    await manager.stop()


# --- real Redis and PostgreSQL servers on loopback (shared stores) ------------------------------

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server on 127.0.0.1, no persistence, stopped after the session."""
    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    process = subprocess.Popen(
        [
            *(REDIS_SERVER, "--bind", "127.0.0.1", "--port", str(port), "--save", ""),
            *("--appendonly", "no", "--dir", str(workdir), "--maxmemory-policy", "noeviction"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def pong() -> bool:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")

    try:
        wait_until(pong, what="redis-server")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        process.wait(timeout=10)


def postgres_bin() -> Path:
    """PostgreSQL's own bin directory (Debian links only some of its programs into PATH)."""
    found = shutil.which("postgres")
    if found:
        return Path(found).resolve().parent
    installed = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"))
    if not installed:
        pytest.fail("PostgreSQL server binaries not found (make test installs them)")
    return installed[-1].parent


@pytest.fixture(scope="session")
def postgresql_url() -> Iterator[str]:
    """A real PostgreSQL server on 127.0.0.1 in a scratch cluster, stopped after the session.

    PostgreSQL refuses to run as root: as root, the cluster belongs to the ``postgres`` account,
    in a directory of its own outside pytest's (root-only) temporary tree.
    """
    port = free_port()
    pg_bin = postgres_bin()
    data = Path(tempfile.mkdtemp(prefix="broker-pg-")) / "data"
    as_user: list[str] = []
    if os.geteuid() == 0:
        shutil.chown(data.parent, "postgres")
        as_user = ["runuser", "-u", "postgres", "--"]
    subprocess.run(
        [*as_user, str(pg_bin / "initdb"), "-D", str(data), "-U", "broker", "-A", "trust"],
        check=True,
        capture_output=True,
    )
    process = subprocess.Popen(
        [
            *(*as_user, str(pg_bin / "postgres"), "-D", str(data), "-h", "127.0.0.1"),
            *("-p", str(port), "-k", str(data), "-c", "fsync=off"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    isready = [str(pg_bin / "pg_isready"), "-h", "127.0.0.1", "-p", str(port)]
    try:
        wait_until(
            lambda: subprocess.run(isready, capture_output=True, check=False).returncode == 0,
            what="PostgreSQL",
        )
        yield f"postgresql://broker@127.0.0.1:{port}/postgres"
    finally:
        process.terminate()
        process.wait(timeout=20)
        shutil.rmtree(data.parent, ignore_errors=True)


# --- Go's reference code for checkpoints and proofs (golang.org/x/mod/sumdb/{note,tlog}) --------


@pytest.fixture
async def database(postgresql_url: str) -> str:
    """A fresh database on the session's server; its URL."""
    name = f"keys_{secrets.token_hex(6)}"
    admin = await asyncpg.connect(postgresql_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    parts = urlsplit(postgresql_url)
    return urlunsplit(parts._replace(path=f"/{name}"))


@pytest.fixture(scope="session")
def go_verifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/go_reference built once: reads a JSON case (verifier key, checkpoint, inclusion and
    consistency proofs) on stdin, exits non-zero naming the first check that fails."""
    go = shutil.which("go")
    assert go, "Go is needed for the reference verifier (the machine image has it)"
    binary = tmp_path_factory.mktemp("goref") / "goref"
    subprocess.run(
        [go, "build", "-o", str(binary), "."],
        cwd=Path(__file__).resolve().parents[1] / "go_reference",
        check=True,
        capture_output=True,
        timeout=600,
        env={**os.environ, "GOFLAGS": "-mod=mod"},
    )
    return binary

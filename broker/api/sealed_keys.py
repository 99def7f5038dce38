"""The keys a sealed broker makes inside its TEE (``[sealed] make_keys``, on by default).

Whoever supplies a key file to the broker holds that key: with operator-supplied keys the
operator can impersonate the broker's TLS endpoint, sign checkpoints of a forked log, or issue
attestation results. A sealed broker therefore makes its keys itself, at start-up, before it asks
the launcher for the token that binds them (``self_attestation.py``):

* **TLS**: a new EC P-256 key and a self-signed certificate each start. Clients trust it through
  the attestation (``BrokerIdentity(tls_trust="attestation")``: the token binds this key), not
  through a CA whose signer the operator controls. The key never outlives the process.
* **statement** (query-key statements), **checkpoint** (the log's note signatures) and
  **result** (attestation results, with ``[attest] enabled``): made once, when the setting is
  unset, and kept only wrapped by the KEK in ``[sealed] key_file`` (JSON; default
  ``sealed-keys.json`` beside the log): the next start, another worker or another replica
  sharing the file unwraps them, so the log keeps one checkpoint key across restarts and every
  replica verifies the others' results. The file is not secret; only the KEK opens it, and with
  Cloud KMS behind Workload Identity Federation the KEK answers only the attested image
  (docs/deploy.md). A key held in Cloud KMS or an HSM (``cloudkms:``/``pkcs11:``) stays there.

The plaintext keys go to a new private directory on ``/dev/shm`` (memory, inside the TEE;
mode 0700, files 0600) for the serving processes, named to them through the ``BROKER_…``
environment overrides; the directory is removed when the broker stops (and, after a SIGKILL, at
the next start). The file is completed under an exclusive lock, so two replicas starting at once
(or a role added later) end with one key per role. Only the primary KEK opens it: a key sealed
under a ``kek_previous`` (which may be one the operator can use) stops the start.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import fcntl
import ipaddress
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from pathlib import Path
from urllib.parse import urlsplit

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from broker.config import Settings, makes_keys
from broker.core.errors import ConfigError, UpstreamError
from broker.keys.factory import open_kek_ring
from broker.keys.kek.ring import KekRing

log = logging.getLogger(__name__)

SEALED_FORMAT = "broker-sealed-keys/v1"
PRIVATE_PREFIX = "broker-sealed-"  # /dev/shm/broker-sealed-<pid>-<random>
TLS_DAYS = 90  # restart to rotate (a restart makes a new key and a new token)
MAX_FILE_BYTES = 64 * 1024
# role -> (the setting it fills, the environment override naming it for the workers)
ROLES = {
    "statement": "BROKER_KEYS_SIGNING_KEY",
    "checkpoint": "BROKER_AUDIT_SIGNING_KEY",
    "result": "BROKER_ATTEST_SIGNING_KEY",
}


@dataclass(frozen=True)
class MadeKeys:
    """The settings the broker serves with, the overrides that name the same files to its
    workers, and the private directory holding them (removed by ``discard``)."""

    settings: Settings
    environ: dict[str, str]
    directory: Path

    def discard(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def sealed_key_file(settings: Settings) -> Path:
    return settings.sealed.key_file or settings.audit.log.parent / "sealed-keys.json"


def roles_to_make(settings: Settings) -> list[str]:
    """The persistent keys this broker makes: each whose setting is unset."""
    roles = []
    if settings.keys.signing_key is None:
        roles.append("statement")
    if settings.audit.signing_key is None:
        roles.append("checkpoint")
    if settings.attest.enabled and settings.attest.signing_key is None:
        roles.append("result")
    return roles


async def make_sealed_keys(settings: Settings, *, now: datetime) -> MadeKeys:
    """Make the TLS key, unseal (or make and seal) the persistent keys, and write them where the
    serving processes read them.

    Raises:
        ConfigError: ``make_keys`` is off, the key file is malformed, or the KEK refuses it.
        UpstreamError: the KEK (KMS, HSM) does not answer.
    """
    if not makes_keys(settings):
        raise ValueError("make_sealed_keys needs [sealed] launcher_socket and make_keys")
    roles = roles_to_make(settings)
    async with open_kek_ring(settings.keys) as ring:
        if ring.primary.development_only:
            log.warning(
                "sealed broker with a development KEK (%s): whoever can read that file can "
                "unwrap every key; use Cloud KMS behind Workload Identity Federation",
                ring.primary.reference,
            )
        keys = await _persistent_keys(ring, sealed_key_file(settings), roles)
    directory, environ, paths = await asyncio.to_thread(_write_keys, settings, keys, now)
    cert_path, key_path = (
        Path(environ["BROKER_SERVER_TLS_CERT"]),
        Path(environ["BROKER_SERVER_TLS_KEY"]),
    )
    made = replace(
        settings,
        server=replace(settings.server, tls_cert=cert_path, tls_key=key_path),
        keys=replace(settings.keys, signing_key=_path(paths.get("statement"))),
        audit=replace(settings.audit, signing_key=paths.get("checkpoint")),
        attest=replace(
            settings.attest, signing_key=paths.get("result", settings.attest.signing_key)
        ),
        sealed=replace(settings.sealed, make_keys=False),
    )
    if settings.audit.signing_key is not None:  # held in KMS/HSM: keep the configured one
        made = replace(made, audit=replace(made.audit, signing_key=settings.audit.signing_key))
    if settings.keys.signing_key is not None:
        made = replace(made, keys=replace(made.keys, signing_key=settings.keys.signing_key))
    log.info("sealed broker made its keys: tls (new), %s", ", ".join(sorted(keys)) or "none")
    return MadeKeys(made, environ, directory)


def _write_keys(
    settings: Settings, keys: dict[str, PrivateKeyTypes], now: datetime
) -> tuple[Path, dict[str, str], dict[str, str]]:
    """A new TLS key and certificate, and every key in PEM, in a new private directory; the
    directory, the workers' overrides naming the files, and each role's path."""
    directory = _private_directory()
    try:
        tls_key = ec.generate_private_key(ec.SECP256R1())
        tls_cert = _self_signed(tls_key, _names(settings), now)
        cert_path = directory / "tls.pem"
        _write_private(cert_path, tls_cert.public_bytes(serialization.Encoding.PEM))
        key_path = directory / "tls.key"
        _write_private(key_path, _pem(tls_key))
        environ = {
            "BROKER_SERVER_TLS_CERT": str(cert_path),
            "BROKER_SERVER_TLS_KEY": str(key_path),
            "BROKER_SEALED_MAKE_KEYS": "false",  # the workers serve with these, never remake
        }
        paths: dict[str, str] = {}
        for role, key in keys.items():
            path = directory / f"{role}.pem"
            _write_private(path, _pem(key))
            paths[role] = str(path)
            environ[ROLES[role]] = str(path)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return directory, environ, paths


def _path(value: str | None) -> Path | None:
    return None if value is None else Path(value)


def _aad(role: str) -> bytes:
    return f"{SEALED_FORMAT}\0{role}".encode()


async def _persistent_keys(
    ring: KekRing, path: Path, roles: list[str]
) -> dict[str, PrivateKeyTypes]:
    """Each role's key from the sealed file, making (and sealing in) those it lacks. The file is
    read, completed and replaced under an exclusive lock on ``<file>.lock``: two replicas
    starting at once, or a role added later ([attest] turned on), never end with two keys."""
    if not roles:
        return {}
    lock = await asyncio.to_thread(_lock, path)
    try:
        entries = await asyncio.to_thread(_read_sealed, path)
        missing = [role for role in roles if role not in entries]
        for role in missing:
            der = _new_key(role).private_bytes(
                serialization.Encoding.DER,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
            wrapped = await ring.primary.wrap(der, _aad(role))
            entries[role] = {
                "kek": ring.primary.reference,
                "wrapped": base64.b64encode(wrapped).decode(),
            }
        if missing:
            await asyncio.to_thread(write_sealed, path, entries)
            log.warning("sealed broker made new keys %s, sealed in %s", missing, path)
        return {role: await _unseal(ring, path, role, entries[role]) for role in roles}
    finally:
        await asyncio.to_thread(os.close, lock)


def _lock(path: Path) -> int:
    """An exclusive ``flock`` on ``<path>.lock`` (blocking); the descriptor holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor


async def _unseal(ring: KekRing, path: Path, role: str, entry: dict[str, str]) -> PrivateKeyTypes:
    if entry["kek"] != ring.primary.reference:  # a kek_previous may be one the operator can use
        raise ConfigError(
            "sealed.key_file",
            f"{path}: the {role} key is sealed under {entry['kek']}, not [keys] kek "
            f"({ring.primary.reference}); a sealed broker opens its keys with its primary KEK "
            "only. Move the file aside to make new keys (a checkpoint-key change monitors see)",
        )
    try:
        wrapped = base64.b64decode(entry["wrapped"], validate=True)
        der = await ring.primary.unwrap(wrapped, _aad(role))
    except ValueError as exc:
        raise ConfigError("sealed.key_file", f"{path}: the {role} key is not base64") from exc
    except UpstreamError as exc:  # not configured, refused (another image), or unreachable
        raise ConfigError(
            "sealed.key_file", f"{path}: the KEK did not open the {role} key: {exc.message}"
        ) from exc
    try:
        key = serialization.load_der_private_key(der, password=None)
    except ValueError as exc:
        raise ConfigError("sealed.key_file", f"{path}: the {role} key is not a key") from exc
    expected = ed25519.Ed25519PrivateKey if role == "checkpoint" else ec.EllipticCurvePrivateKey
    if not isinstance(key, expected):
        raise ConfigError("sealed.key_file", f"{path}: the {role} key has the wrong type")
    return key


def _new_key(role: str) -> PrivateKeyTypes:
    if role == "checkpoint":  # note signatures (C2SP signed-note): Ed25519
        return ed25519.Ed25519PrivateKey.generate()
    return ec.generate_private_key(ec.SECP256R1())


def _read_sealed(path: Path) -> dict[str, dict[str, str]]:
    """The file's entries (none when it does not exist).

    Raises:
        ConfigError: unreadable, too large, or not this format.
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ConfigError("sealed.key_file", f"cannot read {path}: {exc.strerror}") from exc
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError("sealed.key_file", f"{path} is larger than {MAX_FILE_BYTES} bytes")
    try:
        document = json.loads(data)
    except ValueError as exc:
        raise ConfigError("sealed.key_file", f"{path} is not JSON") from exc
    keys = document.get("keys") if isinstance(document, dict) else None
    if (
        not isinstance(document, dict)
        or document.get("format") != SEALED_FORMAT
        or not isinstance(keys, dict)
        or not all(
            role in ROLES
            and isinstance(entry, dict)
            and isinstance(entry.get("kek"), str)
            and isinstance(entry.get("wrapped"), str)
            for role, entry in keys.items()
        )
    ):
        raise ConfigError("sealed.key_file", f"{path} is not a {SEALED_FORMAT} file")
    return {role: dict(entry) for role, entry in keys.items()}


def write_sealed(path: Path, entries: dict[str, dict[str, str]]) -> None:
    """Replace the file atomically (a new file, synced, renamed over it; the caller holds
    the lock)."""
    body = json.dumps({"format": SEALED_FORMAT, "keys": entries}, indent=2, sort_keys=True)
    descriptor, temporary = tempfile.mkstemp(prefix=".sealed-", dir=path.parent)
    try:
        with os.fdopen(descriptor, "w") as handle:
            handle.write(body + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def _private_directory() -> Path:
    """A new 0700 directory in memory, named after this process; those of processes that died
    without removing theirs (SIGKILL, OOM) are removed first."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())  # noqa: S108
    for stale in base.glob(f"{PRIVATE_PREFIX}*-*"):
        pid = stale.name.removeprefix(PRIVATE_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)) and stale.stat().st_uid == os.getuid():
            shutil.rmtree(stale, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{PRIVATE_PREFIX}{os.getpid()}-", dir=base))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    return True


def _write_private(path: Path, data: bytes) -> None:
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(data)


def _pem(key: PrivateKeyTypes) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _names(settings: Settings) -> list[x509.GeneralName]:
    """The certificate's names: the hosts of ``[server] public_urls``, and loopback."""
    hosts = {urlsplit(url).hostname for url in settings.server.public_urls} - {None}
    names: list[x509.GeneralName] = []
    for host in sorted(str(h) for h in hosts | {"localhost", "127.0.0.1"}):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def _self_signed(
    key: ec.EllipticCurvePrivateKey, names: list[x509.GeneralName], now: datetime
) -> x509.Certificate:
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sealed broker")])
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + timedelta(days=TLS_DAYS))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )


@contextlib.contextmanager
def discarded(made: MadeKeys | None) -> Iterator[None]:
    """Remove the made keys' directory when the broker stops."""
    try:
        yield
    finally:
        if made is not None:
            made.discard()

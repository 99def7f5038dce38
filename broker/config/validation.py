"""Whole-configuration validation: every section's own checks (``broker.config.checks``), then
the rules that read several sections (sealed brokers, Cloud KMS access, development issuers,
replicas' origins). ``validate_settings`` runs them all, in the order ``load_settings`` always
has.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from broker.config.checks import (
    is_loopback,
    url_allowed,
    validate_attest,
    validate_audit,
    validate_identity,
    validate_issuer,
    validate_keys,
    validate_nonces,
    validate_nvidia,
    validate_policy,
    validate_server,
    validate_snp,
    validate_tdx,
)
from broker.config.kbs import validate_kbs
from broker.config.sections import ServerSettings, Settings, split_listen
from broker.core.errors import ConfigError
from broker.core.hostnames import in_domain
from broker.core.refs import (
    CloudKmsRef,
    LocalFileRef,
    MemoryRef,
    PostgresRef,
    RedisRef,
    SignerRef,
)


def is_development_issuer(url: str) -> bool:
    """An issuer under the reserved ``.invalid`` domain (RFC 2606): a development issuer
    (``broker dev``, the demo, the tests), never a real one. The host is compared in its one
    normal spelling (``core/hostnames.py``: ``dev.invalid.`` and ``DEV.INVALID`` are
    ``dev.invalid``); an issuer whose host cannot be read counts as one (refused off loopback).
    """
    try:
        host = urlsplit(url).hostname
    except ValueError:
        return True
    return host is None or in_domain(host, "invalid")


def _listens_on_loopback(server: ServerSettings) -> bool:
    try:
        return is_loopback(split_listen(server.listen)[0])
    except ValueError:
        return False


def origin_prefix(origin: str, replica_id: str) -> str | None:
    """What every replica's origin of this deployment starts with (its own origin less its
    replica id), or ``None`` when the origin does not end with ``/<replica id>``."""
    head, _, last = origin.rpartition("/")
    return head + "/" if head and last == replica_id else None


def validate_settings(settings: Settings) -> None:
    validate_server(settings.server, made_by_broker=makes_keys(settings))
    if not settings.issuers:
        raise ConfigError("issuers", "at least one [[issuers]] entry is required")
    seen: set[str] = set()
    for index, issuer in enumerate(settings.issuers):
        validate_issuer(f"issuers[{index}]", issuer)
        if issuer.issuer in seen:
            raise ConfigError(f"issuers[{index}].issuer", "duplicate issuer")
        seen.add(issuer.issuer)
        if is_development_issuer(issuer.issuer) and not _listens_on_loopback(settings.server):
            raise ConfigError(
                f"issuers[{index}].issuer",
                "a development issuer (a *.invalid host, `broker dev`) is trusted only by a "
                "broker that listens on loopback",
            )
    validate_policy(settings.policy)
    validate_audit(settings.audit)
    validate_keys(settings.keys)
    for digest in (*settings.admin.token_sha256, *(d for d, _ in settings.admin.tokens)):
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ConfigError("admin.token_sha256", "each entry is 64 lower-case hex characters")
    validate_nvidia(settings.nvidia)
    validate_tdx(settings.tdx)
    validate_snp(settings.snp)
    validate_nonces(settings.nonces)
    validate_attest(settings.attest, made_by_broker=makes_keys(settings))
    validate_identity(settings.identity, attest_enabled=settings.attest.enabled)
    validate_kbs(settings)
    _validate_sealed(settings)
    _validate_kms_access(settings)
    if settings.server.workers > 1 and isinstance(settings.nonces.store_ref, MemoryRef):
        raise ConfigError(
            "nonces.store",
            "memory nonces live in one process; with [server] workers > 1 use sqlite:///PATH, "
            "redis://… or postgresql://… (or leave it unset for the SQLite default)",
        )
    _validate_replica_origin(settings)
    if sum(1 for i in settings.issuers if i.kind == "nras") > 1:
        raise ConfigError("issuers", "at most one nras issuer entry")


def _validate_sealed(settings: Settings) -> None:
    sealed = settings.sealed
    if sealed.renew_seconds < 1 or not 0 < sealed.timeout_seconds <= 120:
        raise ConfigError("sealed", "renew_seconds >= 1 and 0 < timeout_seconds <= 120")
    if sealed.launcher_socket is not None and settings.server.insecure_http:
        raise ConfigError(
            "sealed.launcher_socket", "an attested broker binds its TLS key: serve TLS"
        )
    if makes_keys(settings):
        operator_files = {
            "server.tls_cert": settings.server.tls_cert,
            "server.tls_key": settings.server.tls_key,
            "keys.signing_key": settings.keys.signing_key,
            "audit.signing_key": _local_key(settings.audit.signing_ref),
            "attest.signing_key": _local_key(settings.attest.signing_ref),
            # the workload-certificate CA's key: a file the operator holds signs any SPIFFE ID
            "identity.ca_key": _local_key(settings.identity.ca_key_ref)
            if settings.identity.enabled
            else None,
        }
        for key, value in operator_files.items():
            if value is not None:
                raise ConfigError(
                    key,
                    "a sealed broker makes its own keys inside the TEE; remove this file, or set "
                    "[sealed] make_keys = false to serve with the operator's keys "
                    "(docs/threat-model.md: the operator then holds them)",
                )


def makes_keys(settings: Settings) -> bool:
    """The broker makes its own keys at start-up (``[sealed]`` with ``make_keys``)."""
    return settings.sealed.launcher_socket is not None and settings.sealed.make_keys


def _local_key(ref: SignerRef | None) -> str | None:
    """A key setting that names a file (not a KMS or HSM key), else ``None``."""
    return ref.uri if isinstance(ref, LocalFileRef) else None


def _validate_kms_access(settings: Settings) -> None:
    """A sealed broker that holds a key in Cloud KMS reaches it only as its attested self.

    Application Default Credentials are the VM's service account, which whoever administers the
    project can use from anywhere; the broker presents its attestation token instead (Workload
    Identity Federation, ``cloud/federation.py``, which also checks the file's content when it
    loads it). The endpoint must be Google's: the broker sends it that token and the DEKs.
    """
    keys = settings.keys
    if keys.kms_credentials is not None and not keys.kms_credentials.is_file():
        raise ConfigError("keys.kms_credentials", f"no such file: {keys.kms_credentials}")
    uses_kms = any(
        isinstance(ref, CloudKmsRef)
        for ref in (
            *keys.kek_refs,
            settings.audit.signing_ref,
            settings.audit.previous_signing_ref,
            settings.attest.signing_ref,
            settings.identity.ca_key_ref,
        )
    )
    if settings.sealed.launcher_socket is None or not uses_kms:
        return
    if keys.kms_credentials is None:
        raise ConfigError(
            "keys.kms_credentials",
            "a sealed broker reaches Cloud KMS only with its own attestation (Workload Identity "
            "Federation): name the credential configuration deploy/confidential-space/broker/"
            "wif.sh writes; Application Default Credentials would be the VM's service account",
        )
    host = (urlsplit(f"//{keys.kms_endpoint}").hostname or "").lower()
    if not (host == "googleapis.com" or host.endswith(".googleapis.com") or is_loopback(host)):
        raise ConfigError(
            "keys.kms_endpoint",
            "a sealed broker sends its KMS token and DEKs only to a *.googleapis.com endpoint",
        )


def _validate_replica_origin(settings: Settings) -> None:
    """Replicas of one deployment (a nonce store shared across hosts, or peers) never share an
    origin: each signs its own log's checkpoints, so the origin must end with the replica id.

    Raises:
        ConfigError: ``audit.origin`` when two replicas would sign under one origin.
    """
    audit = settings.audit
    shared = isinstance(settings.nonces.store_ref, RedisRef | PostgresRef)
    if (shared or audit.peer_url) and origin_prefix(
        audit.origin, settings.server.replica_id
    ) is None:
        raise ConfigError(
            "audit.origin",
            "replicas sharing a store each keep their own log: end the origin with "
            '"/{replica}" (every replica would otherwise sign checkpoints under one origin)',
        )
    if audit.peer_url is not None:
        parts = urlsplit(audit.peer_url.replace("{replica}", "replica"))
        if "{replica}" not in audit.peer_url or not url_allowed(
            audit.peer_url.replace("{replica}", "r")
        ):
            raise ConfigError("audit.peer_url", "an https URL with {replica} (http on loopback)")
        if parts.path not in ("", "/") or parts.query or parts.username:
            raise ConfigError("audit.peer_url", "scheme, host and port only")

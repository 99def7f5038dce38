"""One typed configuration, loaded from TOML plus ``BROKER_…`` environment overrides.

Loaded and validated once at start-up; a bad value raises ``ConfigError`` naming the key (the CLI
prints it and exits non-zero). Relative paths are resolved against the directory of the config
file, so a config file and the files it names can move together.

Environment overrides: ``BROKER_<SECTION>_<KEY>`` (upper case) replaces ``[section] key``, e.g.
``BROKER_SERVER_LISTEN=127.0.0.1:9443`` or ``BROKER_KEYS_KEK=local:/srv/kek.key``. The
``[[issuers]]`` list has no environment form: trust anchors come from the file only.
"""

from __future__ import annotations

import hmac
import os
import re
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from broker.attestation.issuers import DEFAULT_ALGORITHMS, IssuerSettings
from broker.config.tables import (
    config_table,
    convert_value,
    resolve_local_kek,
    resolve_path,
    resolve_sqlite_store,
    resolve_sqlite_uri,
)
from broker.core.errors import ConfigError, FileFormatError
from broker.core.hostnames import in_domain, is_loopback_host
from broker.core.refs import (
    BundleRef,
    CloudKmsRef,
    GcsBundleRef,
    KekRef,
    LocalFileRef,
    MemoryRef,
    PostgresRef,
    RedisRef,
    SecretManagerRef,
    SignerRef,
    SqliteRef,
    StoreRef,
    bundle_ref,
    kek_ref,
    signer_ref,
    store_ref,
)

ISSUER_KINDS = frozenset({"gca", "ita", "nras"})
# Signature algorithms each kind of issuer uses when the entry does not list its own.
MAX_WORKERS = 64
EVENT_LOOPS = ("uvloop", "asyncio")
MAX_EAR_TTL_SECONDS = 900  # attestation results live at most this long (issue 19)
REPLICA_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


def nonce_store_setting(store: str) -> str:
    """A resolved ``[nonces] store`` as it must be written to be read back unchanged (a resolved
    SQLite path is absolute: ``sqlite:///`` followed by ``/…``)."""
    ref = store_ref(store, "nonces.store")
    return f"sqlite:///{ref.path}" if isinstance(ref, SqliteRef) else store


def default_replica_id() -> str:
    """The host name's first label (a pod's name on Kubernetes), or "broker" if it has none."""
    label = socket.gethostname().split(".", 1)[0]
    return label if REPLICA_ID.fullmatch(label) else "broker"


TOKEN_TYPES = frozenset({"oidc", "pki"})
# Algorithms an issuer entry may allow. Asymmetric only: HMAC with a public key is a classic
# confusion attack, and `none` is never a signature.
ALLOWED_TOKEN_ALGORITHMS = frozenset({"RS256", "PS384", "ES384"})


@dataclass(frozen=True)
class ServerSettings:
    listen: str = "127.0.0.1:8443"
    audience: str = ""
    tls_cert: Path | None = None
    tls_key: Path | None = None
    insecure_http: bool = False
    max_body_bytes: int = 256 * 1024
    nonce_ttl_seconds: int = 120
    max_outstanding_nonces: int = 1_000_000  # spent within one TTL, each namespace (memory, SQLite)
    clock_leeway_seconds: int = 30
    # Slow-client limits (docs/configuration.md): a connection that has not sent a complete
    # request head in header_timeout_seconds is closed; an idle keep-alive connection is closed
    # after keepalive_timeout_seconds; a body must arrive within body_timeout_seconds (408).
    header_timeout_seconds: float = 10.0
    keepalive_timeout_seconds: float = 15.0
    body_timeout_seconds: float = 30.0
    max_connections_per_ip: int = 256  # further connections from that address are closed
    # /v1/challenge and /v1/release, each: requests per second per client address, per worker
    # (429 rate_limited with Retry-After past it); 0: off. Bursts of rate_limit_burst.
    rate_limit_per_ip: float = 100.0
    rate_limit_burst: int = 200
    # GET /readyz answers from checks run in the background every health_interval_seconds (one
    # cheap call per store each time); it is limited to readyz_rate_per_ip requests per second
    # per client address, per worker (0: off), in bursts of readyz_burst.
    health_interval_seconds: float = 5.0
    readyz_rate_per_ip: float = 5.0
    readyz_burst: int = 20
    event_loop: str = "uvloop"  # or "asyncio" (the standard library's loop)
    # Names this replica in every decision record and in the default log file name
    # ("{replica}" in [audit] log); default: the host name (a pod's name on Kubernetes).
    replica_id: str = field(default_factory=default_replica_id)
    # Processes serving the same port (SO_REUSEPORT) under one supervisor; 1: no supervisor.
    workers: int = 1
    # A Server-Timing header on each release answer: where its time went, stage by stage
    # (bench/release_bench.py --single). Off by default: timings are for the operator.
    server_timing: bool = False
    # The base URLs runners reach this broker at (behind a proxy: the proxy's). A DPoP proof's
    # htu must name one of them (+ the route's path); the request's own Host header is never
    # used. Empty: the audience, when it is an http(s) URL.
    public_urls: tuple[str, ...] = ()

    @property
    def public_base_urls(self) -> tuple[str, ...]:
        """``public_urls``, or the audience when it is an absolute http(s) URL (else none:
        every DPoP proof is then refused as made for another URL)."""
        if self.public_urls:
            return self.public_urls
        parts = urlsplit(self.audience)
        return (self.audience,) if parts.scheme in ("https", "http") and parts.hostname else ()

    @property
    def host(self) -> str:
        return split_listen(self.listen)[0]

    @property
    def port(self) -> int:
        return split_listen(self.listen)[1]


@dataclass(frozen=True)
class NvidiaSettings:
    """Local verification of raw NVIDIA GPU evidence (evidence kind ``nvidia``)."""

    device_root: Path | None = None  # NVIDIA Device Identity CA; unset: local GPU path off
    rim_root: Path | None = None  # NVIDIA CoRIM signing root
    rim_dir: Path | None = None  # <dir>/<RIM id>.swidtag, read first
    rim_url: str | None = (
        None  # NVIDIA RIM service base, e.g. https://rim.attestation.nvidia.com/v1/rim
    )
    ocsp_url: str | None = None  # e.g. https://ocsp.ndis.nvidia.com/ ; unset: OCSP "unknown"
    upstream_timeout_seconds: int = 10
    rim_cache_seconds: int = 86400
    ocsp_cache_seconds: int = 3600  # good/revoked answers; 0 asks every time

    @property
    def enabled(self) -> bool:
        return self.device_root is not None


POLICY_ENGINES = frozenset({"wasm", "opa"})


@dataclass(frozen=True)
class PolicySettings:
    """``[policy]``: which engine decides, and where the policy comes from (docs/policy.md)."""

    engine: str = "wasm"  # "wasm": OPA-compiled Wasm in process | "opa": an OPA server
    dir: Path = Path("policies")  # Rego + data.json, compiled at load and reload (wasm)
    bundle: Path | None = None  # or a pre-built bundle from `broker policy build` (wasm)
    # or a bundle server: https://… (http:// on loopback) or gs://BUCKET/OBJECT, polled every
    # reload_seconds (ETag / generation); replicas converge within one interval
    bundle_url: str | None = None
    bundle_verification_key: Path | None = None  # require a bundle signed with this key
    # the signature's scope must equal this (as OPA's --scope): required, naming the
    # environment (e.g. "prod"), whenever bundle_verification_key is set
    bundle_verification_scope: str = ""
    bundle_ca: Path | None = None  # PEM CA(s) for an https bundle_url server with a private CA
    opa_url: str | None = None  # engine = "opa"
    opa_binary: Path | None = None  # compiles `dir`; default: next to the broker, or on PATH
    reload_seconds: int = 5  # poll dir/bundle for changes; 0 = only SIGHUP / admin reload
    eval_timeout_ms: int = 500  # engine = "opa": no answer in time is 503 policy_unavailable

    @cached_property
    def bundle_ref(self) -> BundleRef | None:
        """``bundle_url`` parsed (core/refs.py), once."""
        return None if self.bundle_url is None else bundle_ref(self.bundle_url)


@dataclass(frozen=True)
class KeySettings:
    # or postgresql://USER@HOST/DB (replicas; `broker keys migrate` first),
    # or secretmanager:projects/P
    store: str = "sqlite:////var/lib/broker/keys.db"  # sqlite:///keys.db: beside the config
    kek: str = "local:/var/lib/broker/kek.key"  # or pkcs11:… or cloudkms:projects/…
    kek_previous: tuple[str, ...] = ()  # older KEKs: unwrap only, until `keys rewrap` is done
    kms_endpoint: str = "cloudkms.googleapis.com"
    # Workload Identity Federation credential configuration (type external_account; written by
    # deploy/confidential-space/broker/wif.sh): the KMS clients present the broker's own
    # attestation token. Unset: Application Default Credentials (refused when sealed).
    kms_credentials: Path | None = None
    secretmanager_endpoint: str = "secretmanager.googleapis.com"
    upstream_timeout_seconds: int = 10  # KMS / Secret Manager: per call, retries included
    dek_cache_seconds: int = 300
    dek_cache_max: int = 1024
    # A release reads key metadata from memory; another process's lifecycle change (disable,
    # destroy, rotate) takes effect here within this bound. 0: read the store on every release.
    metadata_cache_seconds: float = 1.0
    signing_key: Path | None = None  # EC P-256 PEM that signs query-key statements

    @cached_property
    def store_ref(self) -> StoreRef:
        """``store`` parsed (core/refs.py), once. Raises: ConfigError."""
        return store_ref(self.store, "keys.store")

    @cached_property
    def kek_refs(self) -> tuple[KekRef, ...]:
        """``kek`` then each ``kek_previous``, parsed once. Raises: ConfigError naming it."""
        names = ["keys.kek", *(f"keys.kek_previous[{i}]" for i in range(len(self.kek_previous)))]
        return tuple(
            kek_ref(uri, name)
            for uri, name in zip((self.kek, *self.kek_previous), names, strict=True)
        )


@dataclass(frozen=True)
class AuditSettings:
    log: Path = Path("/var/lib/broker/decisions-{replica}.log")  # {replica}: [server] replica_id
    # Checkpoints' origin line and note key name: one per replica, so the last part is the
    # replica id ("{replica}": [server] replica_id); a deployment of several replicas (a shared
    # nonce store, or peer_url) must end it with "{replica}" (docs/audit.md, "Replicas")
    origin: str = "broker.invalid/decisions/{replica}"
    # Ed25519 PEM path, or "cloudkms:projects/…/cryptoKeyVersions/N" (EC_SIGN_ED25519);
    # unset: no checkpoints (docs/audit.md)
    signing_key: str | None = None
    checkpoint_seconds: float = 1.0  # a new checkpoint at most this often, after new records
    sink: str | None = None  # "syslog://host:514" | "https://siem/ingest": best-effort stream
    segment_bytes: int = 256 * 1024 * 1024  # rotate into <log>.000001, … past this; 0: never
    witnesses: tuple[str, ...] = ()  # tlog-witness URLs: each checkpoint is offered for cosigning
    witness_keys: tuple[str, ...] = ()  # their cosignature/v1 keys, in the same order
    # JSON pointers into the policy input replaced by their HMAC-SHA-256 in records
    # (broker.audit.mask), keyed by mask_key: 32 random bytes in a file, created (0600) at
    # start-up or by `broker audit key` when absent; default <log directory>/mask.key
    mask: tuple[str, ...] = ()
    mask_key: Path | None = None
    # Where the other replicas of this deployment answer ("{replica}": a replica id), so that
    # each log is reachable by its origin through any replica: e.g.
    # "https://{replica}.broker-headless.broker.svc.cluster.local:8443"; unset: none
    peer_url: str | None = None
    peer_ca: Path | None = None  # the CA of the peers' TLS certificates (default: the system's)
    # The key that signed this log's checkpoints until signing_key replaced it: the broker then
    # signs a hand-over naming the new key and records the rotation (docs/audit.md)
    previous_signing_key: str | None = None

    @cached_property
    def signing_ref(self) -> SignerRef | None:
        """``signing_key`` parsed (core/refs.py), once."""
        return None if self.signing_key is None else signer_ref(self.signing_key)

    @cached_property
    def previous_signing_ref(self) -> SignerRef | None:
        return None if self.previous_signing_key is None else signer_ref(self.previous_signing_key)


NONCE_STORE_FORMS = (
    "expected memory, sqlite:///PATH, redis://HOST:PORT/DB or postgresql://USER@HOST/DB"
)


@dataclass(frozen=True)
class NonceSettings:
    """``[nonces]``: how challenges are made and where spent nonces live (TTL and the spent-nonce
    bound stay in ``[server]``).

    Challenges are stateless (MAC'd with ``challenge_key``); the store keeps spent nonces until
    they expire. ``memory`` serves one process; ``sqlite:///PATH`` processes on one host;
    ``redis://…`` or ``postgresql://…`` replicas. Every use of a nonce, in any process or
    replica, goes through this one store.
    """

    # Empty: "memory" with one worker; with [server] workers > 1,
    # sqlite:///<audit log directory>/nonces.db.
    store: str = ""
    timeout_seconds: float = 2.0  # per store call; no answer is 503 nonce_store_unavailable
    # 32 random bytes keying the challenges' MAC (created 0600 if absent). Default: beside the
    # log (the workers of a host share it); replicas behind one load balancer need one file.
    challenge_key: Path | None = None

    @cached_property
    def store_ref(self) -> StoreRef:
        """``store`` parsed (core/refs.py), once. Raises: ConfigError."""
        return store_ref(self.store, "nonces.store")


@dataclass(frozen=True)
class AdminSettings:
    """Admin API credentials: SHA-256 (hex) of each accepted bearer token.

    Only digests live in the config file; an admin presents ``Authorization: Bearer <token>``.
    ``token_sha256`` tokens hold every role; ``[[admin.tokens]]`` entries (``sha256``, ``roles``)
    hold the roles they list (``ADMIN_ROLES``). With no token configured the admin API refuses
    every request.
    """

    token_sha256: tuple[str, ...] = ()
    tokens: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (sha256, roles)

    def roles_of(self, digest: str) -> frozenset[str]:
        """The roles of the token with this SHA-256 digest (empty: unknown token)."""
        roles: set[str] = set()
        for known in self.token_sha256:
            if hmac.compare_digest(known, digest):
                roles |= ADMIN_ROLES
        for known, granted in self.tokens:
            if hmac.compare_digest(known, digest):
                roles |= set(granted)
        return frozenset(roles)


ADMIN_ROLES = frozenset({"key-admin", "policy-admin", "auditor"})


@dataclass(frozen=True)
class AttestSettings:
    """``POST /v1/attest``: attestation results (EAR) bound to the runner's keys, and releases
    on them (``Authorization: DPoP``; docs/api.md). Off by default."""

    enabled: bool = False
    signing_key: str | None = None  # EC P-256 PEM path, cloudkms:…/cryptoKeyVersions/N, pkcs11:…
    ttl_seconds: int = 300  # 1..900; never past the first expiry of the evidence used
    legacy_names: bool = False  # Veraison's dotted claim names and profile
    # public PEM files of result keys replaced by a rotation: still published and accepted,
    # so results they signed keep working until they expire (remove after ttl_seconds)
    previous_keys: tuple[str, ...] = ()
    dpop_nonce: bool = True  # a release's DPoP proof must carry this broker's DPoP-Nonce

    @cached_property
    def signing_ref(self) -> SignerRef | None:
        """``signing_key`` parsed (core/refs.py), once."""
        return None if self.signing_key is None else signer_ref(self.signing_key)


@dataclass(frozen=True)
class SealedSettings:
    """``[sealed]``: the broker attests itself through the Confidential Space launcher and
    publishes the token at ``/.well-known/broker-attestation`` (docs/api.md). Off by default."""

    # The launcher's Unix socket (Confidential Space: /run/container_launcher/teeserver.sock);
    # unset: not attested. Set: a launcher that does not answer at start-up stops the broker.
    launcher_socket: Path | None = None
    token_audience: str = ""  # the token's aud; empty: [server] audience
    renew_seconds: int = 300  # renew this long before exp (at most half the token's lifetime)
    timeout_seconds: float = 10.0  # one call to the launcher
    # The broker makes its keys inside the TEE (api/sealed_keys.py): a TLS key each start, and
    # the statement, checkpoint and result keys once, kept only sealed by the KEK in key_file.
    # false: the operator's key files are used (the operator then holds them: threat model).
    make_keys: bool = True
    key_file: Path | None = None  # default: sealed-keys.json beside [audit] log


@dataclass(frozen=True)
class Settings:
    server: ServerSettings
    issuers: tuple[IssuerSettings, ...]
    policy: PolicySettings = field(default_factory=PolicySettings)
    keys: KeySettings = field(default_factory=KeySettings)
    audit: AuditSettings = field(default_factory=AuditSettings)
    nvidia: NvidiaSettings = field(default_factory=NvidiaSettings)
    admin: AdminSettings = field(default_factory=AdminSettings)
    nonces: NonceSettings = field(default_factory=NonceSettings)
    attest: AttestSettings = field(default_factory=AttestSettings)
    sealed: SealedSettings = field(default_factory=SealedSettings)


def split_listen(listen: str) -> tuple[str, int]:
    """Split ``host:port`` (``[v6]:port`` for IPv6) into its parts.

    Raises:
        ValueError: when the form or the port is wrong.
    """
    host, sep, port_text = listen.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError("expected host:port")
    port = int(port_text)
    if not 0 <= port <= 65535:
        raise ValueError("port out of range")
    return host.strip("[]"), port


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


def replica_origin(template: str, replica_id: str) -> str:
    """``[audit] origin`` with ``{replica}`` (allowed once, as its last part) expanded.

    Raises:
        ConfigError: ``{replica}`` elsewhere than as the origin's last part.
    """
    if "{replica}" in template and not (
        template.count("{replica}") == 1 and template.endswith("/{replica}")
    ):
        raise ConfigError(
            "audit.origin", "{replica} may appear once, as the last part: …/{replica}"
        )
    return template.replace("{replica}", replica_id)


def origin_prefix(origin: str, replica_id: str) -> str | None:
    """What every replica's origin of this deployment starts with (its own origin less its
    replica id), or ``None`` when the origin does not end with ``/<replica id>``."""
    head, _, last = origin.rpartition("/")
    return head + "/" if head and last == replica_id else None


def is_loopback(host: str) -> bool:
    """True when ``host``, however spelled (``core/hostnames.py``), names only this machine."""
    return is_loopback_host(host)


def load_settings(path: Path, environ: Mapping[str, str] | None = None) -> Settings:
    """Read, override from the environment, and validate a config file.

    Raises:
        ConfigError: naming the first bad key.
    """
    fix = "fix the file (docs/configuration.md)"
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise FileFormatError(
            path,
            f"cannot read the config file ({exc.strerror})",
            "give --config the path of a broker.toml (`broker dev init DIR` writes one)",
        ) from exc
    except UnicodeDecodeError as exc:
        raise FileFormatError(path, "not a TOML config file (not UTF-8 text)", fix) from exc
    except tomllib.TOMLDecodeError as exc:
        raise FileFormatError(path, f"not valid TOML: {exc}", fix) from exc
    return settings_from_mapping(raw, base_dir=path.parent, environ=environ)


def settings_from_mapping(
    raw: Mapping[str, Any], *, base_dir: Path, environ: Mapping[str, str] | None = None
) -> Settings:
    """Build validated ``Settings`` from a parsed TOML document.

    Raises:
        ConfigError: naming the first bad key.
    """
    env = os.environ if environ is None else environ
    known = {
        "server",
        "issuers",
        "policy",
        "keys",
        "audit",
        "nvidia",
        "admin",
        "nonces",
        "attest",
        "sealed",
    }
    for key in raw:
        if key not in known:
            raise ConfigError(key, "unknown section")
    server = config_table(ServerSettings, "server", raw, env, base_dir)
    policy = config_table(PolicySettings, "policy", raw, env, base_dir)
    keys = _keys_resolved(config_table(KeySettings, "keys", raw, env, base_dir), base_dir)
    audit = config_table(AuditSettings, "audit", raw, env, base_dir)
    audit = replace(audit, log=Path(str(audit.log).replace("{replica}", server.replica_id)))
    audit = replace(audit, origin=replica_origin(audit.origin, server.replica_id))
    if audit.mask_key is None:
        audit = replace(audit, mask_key=audit.log.parent / "mask.key")
    if isinstance(audit.signing_ref, LocalFileRef):  # a file: relative to the config
        audit = replace(audit, signing_key=str(resolve_path(base_dir, audit.signing_ref.uri)))
    if isinstance(audit.previous_signing_ref, LocalFileRef):
        previous = audit.previous_signing_ref.uri
        audit = replace(audit, previous_signing_key=str(resolve_path(base_dir, previous)))
    nvidia = config_table(NvidiaSettings, "nvidia", raw, env, base_dir)
    nonces = config_table(NonceSettings, "nonces", raw, env, base_dir)
    if nonces.challenge_key is None:
        nonces = replace(nonces, challenge_key=audit.log.parent / "challenge.key")
    if not nonces.store:
        shared = f"sqlite:///{audit.log.parent / 'nonces.db'}"
        nonces = replace(nonces, store="memory" if server.workers == 1 else shared)
    nonces = replace(nonces, store=resolve_sqlite_store(nonces.store, base_dir))
    admin_raw = dict(raw.get("admin", {})) if isinstance(raw.get("admin", {}), dict) else {}
    token_tables = admin_raw.pop("tokens", [])
    admin = config_table(AdminSettings, "admin", {"admin": admin_raw}, env, base_dir)
    admin = AdminSettings(token_sha256=admin.token_sha256, tokens=_admin_tokens(token_tables))
    issuers = _issuers(raw.get("issuers", []), base_dir)
    attest = config_table(AttestSettings, "attest", raw, env, base_dir)
    if isinstance(attest.signing_ref, LocalFileRef):
        attest = replace(attest, signing_key=str(resolve_path(base_dir, attest.signing_ref.uri)))
    attest = replace(
        attest, previous_keys=tuple(str(resolve_path(base_dir, k)) for k in attest.previous_keys)
    )
    sealed = config_table(SealedSettings, "sealed", raw, env, base_dir)
    if not sealed.token_audience:
        sealed = replace(sealed, token_audience=server.audience)
    settings = Settings(
        sealed=sealed,
        server=server,
        issuers=issuers,
        policy=policy,
        keys=keys,
        audit=audit,
        nvidia=nvidia,
        admin=admin,
        nonces=nonces,
        attest=attest,
    )
    _validate(settings)
    return settings


def _keys_resolved(keys: KeySettings, base_dir: Path) -> KeySettings:
    """``[keys]`` with the SQLite store's and the local KEKs' relative paths made absolute
    against the config file's directory (``sqlite:///keys.db``, ``local:kek.key``).

    Raises:
        ConfigError: ``keys.store`` for a relative path that used to name another file.
    """
    return replace(
        keys,
        store=resolve_sqlite_uri("keys.store", keys.store, base_dir),
        kek=resolve_local_kek(keys.kek, base_dir),
        kek_previous=tuple(resolve_local_kek(uri, base_dir) for uri in keys.kek_previous),
    )


def _admin_tokens(raw: Any) -> tuple[tuple[str, tuple[str, ...]], ...]:
    if not isinstance(raw, list):
        raise ConfigError("admin.tokens", "must be an array of tables ([[admin.tokens]])")
    tokens = []
    for index, table in enumerate(raw):
        key = f"admin.tokens[{index}]"
        if not isinstance(table, dict) or set(table) != {"sha256", "roles"}:
            raise ConfigError(key, "needs exactly sha256 and roles")
        digest, roles = table["sha256"], table["roles"]
        if not isinstance(roles, list) or not roles or set(roles) - ADMIN_ROLES:
            raise ConfigError(f"{key}.roles", f"a non-empty subset of {sorted(ADMIN_ROLES)}")
        tokens.append((str(digest), tuple(sorted(roles))))
    return tuple(tokens)


def _issuers(raw: Any, base_dir: Path) -> tuple[IssuerSettings, ...]:
    if not isinstance(raw, list):
        raise ConfigError("issuers", "must be an array of tables ([[issuers]])")
    allowed = {f.name: f for f in fields(IssuerSettings)}
    result = []
    for index, table in enumerate(raw):
        name = f"issuers[{index}]"
        if not isinstance(table, dict):
            raise ConfigError(name, "must be a table")
        for key in table:
            if key not in allowed:
                raise ConfigError(f"{name}.{key}", "unknown key")
        for required in ("kind", "issuer"):
            if required not in table:
                raise ConfigError(f"{name}.{required}", "is required")
        values = {
            key: convert_value(f"{name}.{key}", value, allowed[key].type, base_dir)
            for key, value in table.items()
        }
        result.append(IssuerSettings(**values))
    return tuple(result)


def _validate(settings: Settings) -> None:
    _validate_server(settings.server, made_by_broker=makes_keys(settings))
    if not settings.issuers:
        raise ConfigError("issuers", "at least one [[issuers]] entry is required")
    seen: set[str] = set()
    for index, issuer in enumerate(settings.issuers):
        _validate_issuer(f"issuers[{index}]", issuer)
        if issuer.issuer in seen:
            raise ConfigError(f"issuers[{index}].issuer", "duplicate issuer")
        seen.add(issuer.issuer)
        if is_development_issuer(issuer.issuer) and not _listens_on_loopback(settings.server):
            raise ConfigError(
                f"issuers[{index}].issuer",
                "a development issuer (a *.invalid host, `broker dev`) is trusted only by a "
                "broker that listens on loopback",
            )
    _validate_policy(settings.policy)
    _validate_audit(settings.audit)
    _validate_keys(settings.keys)
    for digest in (*settings.admin.token_sha256, *(d for d, _ in settings.admin.tokens)):
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ConfigError("admin.token_sha256", "each entry is 64 lower-case hex characters")
    _validate_nvidia(settings.nvidia)
    _validate_nonces(settings.nonces)
    _validate_attest(settings.attest, made_by_broker=makes_keys(settings))
    _validate_sealed(settings)
    _validate_kms_access(settings)
    if settings.server.workers > 1 and settings.nonces.store == "memory":
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


def _validate_policy(policy: PolicySettings) -> None:
    if policy.engine not in POLICY_ENGINES:
        raise ConfigError("policy.engine", f"must be one of {sorted(POLICY_ENGINES)}")
    if policy.eval_timeout_ms <= 0 or policy.reload_seconds < 0:
        raise ConfigError("policy", "eval_timeout_ms must be positive, reload_seconds >= 0")
    if policy.engine == "opa":
        if policy.opa_url is None or not _url_allowed(policy.opa_url):
            raise ConfigError("policy.opa_url", "engine opa needs an https URL (http on loopback)")
        return
    if policy.bundle_url is not None:
        if policy.bundle is not None:
            raise ConfigError("policy.bundle_url", "set bundle_url or bundle, not both")
        ref = policy.bundle_ref
        gcs = isinstance(ref, GcsBundleRef) and bool(ref.bucket) and bool(ref.name)
        if not (gcs or _url_allowed(policy.bundle_url)):
            raise ConfigError(
                "policy.bundle_url", "https://… (http:// only on loopback) or gs://BUCKET/OBJECT"
            )
    elif policy.bundle is not None:
        if not policy.bundle.is_file():
            raise ConfigError("policy.bundle", f"no such file: {policy.bundle}")
    elif not policy.dir.is_dir():
        raise ConfigError("policy.dir", f"not a directory: {policy.dir}")
    _validate_bundle_trust(policy)


def _validate_bundle_trust(policy: PolicySettings) -> None:
    """The signature key, the scope it must name, and the bundle server's CA."""
    key = policy.bundle_verification_key
    bundled = policy.bundle is not None or policy.bundle_url is not None
    if key is not None and (not bundled or not key.is_file()):
        raise ConfigError(
            "policy.bundle_verification_key", "needs policy.bundle or bundle_url, and a PEM file"
        )
    if key is not None and not policy.bundle_verification_scope.strip():
        raise ConfigError(
            "policy.bundle_verification_scope",
            'signed bundles need a scope naming this environment (e.g. "prod"; the '
            "signature's scope must equal it, so a bundle signed for another one is refused)",
        )
    if policy.bundle_ca is not None and (
        policy.bundle_url is None
        or not policy.bundle_url.startswith("https://")
        or not policy.bundle_ca.is_file()
    ):
        raise ConfigError("policy.bundle_ca", "needs an https:// bundle_url and a PEM file")


def _validate_audit(audit: AuditSettings) -> None:
    if audit.checkpoint_seconds <= 0 or audit.segment_bytes < 0:
        raise ConfigError("audit", "checkpoint_seconds must be positive, segment_bytes >= 0")
    if len(audit.witnesses) != len(audit.witness_keys):
        raise ConfigError("audit.witness_keys", "one key per witness URL, in the same order")
    for url in audit.witnesses:
        if not _url_allowed(url):
            raise ConfigError("audit.witnesses", "https URLs (http only on loopback)")
    if audit.sink is not None:
        parts = urlsplit(audit.sink)
        if parts.scheme == "syslog" and parts.hostname:
            return
        if not _url_allowed(audit.sink):
            raise ConfigError("audit.sink", "syslog://HOST:PORT or https://… (http on loopback)")


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
        if "{replica}" not in audit.peer_url or not _url_allowed(
            audit.peer_url.replace("{replica}", "r")
        ):
            raise ConfigError("audit.peer_url", "an https URL with {replica} (http on loopback)")
        if parts.path not in ("", "/") or parts.query or parts.username:
            raise ConfigError("audit.peer_url", "scheme, host and port only")


def _validate_attest(attest: AttestSettings, *, made_by_broker: bool = False) -> None:
    if not 1 <= attest.ttl_seconds <= MAX_EAR_TTL_SECONDS:
        raise ConfigError("attest.ttl_seconds", f"must be 1..{MAX_EAR_TTL_SECONDS}")
    if attest.enabled and attest.signing_key is None and not made_by_broker:
        raise ConfigError("attest.signing_key", "attest needs a result-signing key (EC P-256 PEM)")


def _validate_nonces(nonces: NonceSettings) -> None:
    try:
        ref = nonces.store_ref
    except ConfigError as exc:
        raise ConfigError("nonces.store", NONCE_STORE_FORMS) from exc
    hostless = isinstance(ref, RedisRef | PostgresRef) and not urlsplit(ref.uri).hostname
    if hostless or not isinstance(ref, MemoryRef | SqliteRef | RedisRef | PostgresRef):
        raise ConfigError("nonces.store", NONCE_STORE_FORMS)
    if not nonces.timeout_seconds > 0:
        raise ConfigError("nonces.timeout_seconds", "must be positive")


KEY_STORE_FORMS = "expected sqlite:///PATH, postgresql://USER@HOST/DB or secretmanager:projects/P"


def key_store_ref(uri: str, setting: str) -> StoreRef:
    """``uri`` as a key store (``[keys] store``, ``keys migrate --from/--to``).

    Raises:
        ConfigError: naming ``setting`` for a store that cannot hold keys.
    """
    try:
        ref = store_ref(uri, setting)
    except ConfigError as exc:
        raise ConfigError(setting, KEY_STORE_FORMS) from exc
    if not (
        isinstance(ref, SqliteRef | SecretManagerRef)
        or (isinstance(ref, PostgresRef) and urlsplit(ref.uri).hostname)
    ):
        raise ConfigError(setting, KEY_STORE_FORMS)
    return ref


def _validate_keys(keys: KeySettings) -> None:
    key_store_ref(keys.store, "keys.store")
    keys.kek_refs  # noqa: B018 - parsed here, once: a malformed one names its setting
    if keys.upstream_timeout_seconds <= 0:
        raise ConfigError("keys.upstream_timeout_seconds", "must be positive")
    if keys.dek_cache_seconds < 0 or keys.dek_cache_max < 0 or keys.metadata_cache_seconds < 0:
        raise ConfigError(
            "keys",
            "dek_cache_seconds, dek_cache_max and metadata_cache_seconds must not be negative",
        )
    if keys.metadata_cache_seconds > 60:
        raise ConfigError(
            "keys.metadata_cache_seconds",
            "at most 60: it bounds how long a disabled key stays releasable elsewhere",
        )
    if keys.signing_key is not None and not keys.signing_key.is_file():
        raise ConfigError("keys.signing_key", f"no such file: {keys.signing_key}")


def _validate_nvidia(nvidia: NvidiaSettings) -> None:
    for key in ("device_root", "rim_root", "rim_dir"):
        path = getattr(nvidia, key)
        if path is not None and not path.exists():
            raise ConfigError(f"nvidia.{key}", f"no such file or directory: {path}")
    if nvidia.enabled and nvidia.rim_root is None:
        raise ConfigError("nvidia.rim_root", "is required with device_root")
    if nvidia.enabled and nvidia.rim_dir is None and nvidia.rim_url is None:
        raise ConfigError("nvidia", "rim_dir or rim_url is required with device_root")
    for key in ("rim_url", "ocsp_url"):
        url = getattr(nvidia, key)
        if url is not None and not _url_allowed(url):
            raise ConfigError(f"nvidia.{key}", "must be https (http only on loopback)")
    if nvidia.upstream_timeout_seconds <= 0 or nvidia.rim_cache_seconds <= 0:
        raise ConfigError("nvidia", "timeouts and cache lifetimes must be positive")
    if nvidia.ocsp_cache_seconds < 0:
        raise ConfigError("nvidia.ocsp_cache_seconds", "must not be negative")


def _url_allowed(url: str) -> bool:
    parts = urlsplit(url)
    return parts.scheme == "https" or (parts.scheme == "http" and is_loopback(parts.hostname or ""))


def _validate_server(server: ServerSettings, *, made_by_broker: bool = False) -> None:
    try:
        host, _ = split_listen(server.listen)
    except ValueError as exc:
        raise ConfigError("server.listen", str(exc)) from exc
    if not server.audience:
        raise ConfigError("server.audience", "is required (the audience runners request)")
    if server.insecure_http:
        if not is_loopback(host):
            raise ConfigError(
                "server.insecure_http", "plain HTTP is refused unless listen is a loopback address"
            )
    elif not made_by_broker:
        for key, path in (("server.tls_cert", server.tls_cert), ("server.tls_key", server.tls_key)):
            if path is None:
                raise ConfigError(key, "is required (TLS is the default; see insecure_http)")
            if not path.is_file():
                raise ConfigError(key, f"no such file: {path}")
    limits = {
        "server.max_body_bytes": server.max_body_bytes,
        "server.nonce_ttl_seconds": server.nonce_ttl_seconds,
        "server.max_outstanding_nonces": server.max_outstanding_nonces,
        "server.header_timeout_seconds": server.header_timeout_seconds,
        "server.keepalive_timeout_seconds": server.keepalive_timeout_seconds,
        "server.body_timeout_seconds": server.body_timeout_seconds,
        "server.max_connections_per_ip": server.max_connections_per_ip,
        "server.health_interval_seconds": server.health_interval_seconds,
        "server.readyz_burst": server.readyz_burst,
    }
    for key, value in limits.items():
        if value <= 0:
            raise ConfigError(key, "must be positive")
    if server.readyz_rate_per_ip < 0:
        raise ConfigError("server.readyz_rate_per_ip", "must not be negative (0: off)")
    if not 0 <= server.clock_leeway_seconds <= 300:
        raise ConfigError("server.clock_leeway_seconds", "must be between 0 and 300")
    _validate_public_urls(server.public_urls)
    _validate_processes(server)


def _validate_public_urls(urls: tuple[str, ...]) -> None:
    for url in urls:
        _validate_public_url(url)


def _validate_public_url(url: str) -> None:
    """An absolute https URL (http on loopback), without query, fragment or user info."""
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises on a port out of range
    except ValueError as exc:
        raise ConfigError("server.public_urls", f"{url!r} is not a URL") from exc
    if (
        not _url_allowed(url)
        or not parts.hostname
        or parts.query
        or parts.fragment
        or "@" in parts.netloc
    ):
        raise ConfigError(
            "server.public_urls",
            f"{url!r}: each must be an https URL (http on loopback), no query, fragment or user",
        )


def _validate_processes(server: ServerSettings) -> None:
    if not 1 <= server.workers <= MAX_WORKERS:
        raise ConfigError("server.workers", f"must be between 1 and {MAX_WORKERS}")
    if server.event_loop not in EVENT_LOOPS:
        raise ConfigError("server.event_loop", f"one of {', '.join(EVENT_LOOPS)}")
    if not REPLICA_ID.fullmatch(server.replica_id):
        raise ConfigError("server.replica_id", "1-63 characters: letters, digits, '.', '_', '-'")


def _validate_issuer(name: str, issuer: IssuerSettings) -> None:  # noqa: PLR0912
    if issuer.kind not in ISSUER_KINDS:
        raise ConfigError(f"{name}.kind", f"unknown kind (supported: {sorted(ISSUER_KINDS)})")
    if not issuer.token_types or set(issuer.token_types) - TOKEN_TYPES:
        raise ConfigError(f"{name}.token_types", f"must be a subset of {sorted(TOKEN_TYPES)}")
    if issuer.kind != "gca" and issuer.token_types != ("oidc",):
        raise ConfigError(f"{name}.token_types", "applies to gca issuers only")
    if issuer.uses_jwks and (issuer.jwks_file is None) == (issuer.jwks_url is None):
        raise ConfigError(name, "exactly one of jwks_file or jwks_url is required")
    if issuer.jwks_file is not None and not issuer.jwks_file.is_file():
        raise ConfigError(f"{name}.jwks_file", f"no such file: {issuer.jwks_file}")
    if issuer.jwks_url is not None and not _url_allowed(issuer.jwks_url):
        raise ConfigError(f"{name}.jwks_url", "must be https (http only on loopback)")
    needs_root = issuer.kind != "gca" or "pki" in issuer.token_types
    if needs_root and issuer.root_cert is None:
        raise ConfigError(f"{name}.root_cert", "is required (the pinned trust anchor)")
    if issuer.root_cert is not None and not issuer.root_cert.is_file():
        raise ConfigError(f"{name}.root_cert", f"no such file: {issuer.root_cert}")
    for alg in issuer.effective_algorithms:
        if alg not in ALLOWED_TOKEN_ALGORITHMS:
            raise ConfigError(f"{name}.algorithms", f"algorithm {alg!r} is not allowed")
        if alg not in DEFAULT_ALGORITHMS[issuer.kind]:
            raise ConfigError(f"{name}.algorithms", f"{alg} is not an algorithm {issuer.kind} uses")
    if not 1 <= issuer.max_token_lifetime_seconds <= 86400:
        raise ConfigError(f"{name}.max_token_lifetime_seconds", "must be 1..86400")
    if issuer.jwks_refresh_min_seconds < 1 or issuer.jwks_cache_seconds < 1:
        raise ConfigError(name, "JWKS cache and refresh intervals must be positive")

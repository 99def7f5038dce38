"""Each section's own checks: limits, paths that must exist, URLs that must be https (http only
on loopback), store and KEK forms. Checks that read more than one section live in
``broker.config.validation``, which runs these.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from broker.attestation.issuers import DEFAULT_ALGORITHMS, IssuerSettings
from broker.config.sections import (
    NONCE_STORE_FORMS,
    REPLICA_ID,
    AttestSettings,
    AuditSettings,
    IdentitySettings,
    KeySettings,
    NonceSettings,
    NvidiaSettings,
    PolicySettings,
    ServerSettings,
    SnpSettings,
    TdxSettings,
    split_listen,
)
from broker.core.errors import ConfigError
from broker.core.hostnames import is_loopback_host
from broker.core.refs import (
    GcsBundleRef,
    MemoryRef,
    PostgresRef,
    RedisRef,
    SecretManagerRef,
    SqliteRef,
    StoreRef,
    store_ref,
)
from broker.crypto.svid import valid_trust_domain

ISSUER_KINDS = frozenset({"gca", "ita", "nras"})
MAX_WORKERS = 64
EVENT_LOOPS = ("uvloop", "asyncio")
MAX_EAR_TTL_SECONDS = 900  # attestation results live at most this long (issue 19)

TOKEN_TYPES = frozenset({"oidc", "pki"})
# Algorithms an issuer entry may allow. Asymmetric only: HMAC with a public key is a classic
# confusion attack, and `none` is never a signature.
ALLOWED_TOKEN_ALGORITHMS = frozenset({"RS256", "PS384", "ES384"})

POLICY_ENGINES = frozenset({"wasm", "opa"})


def is_loopback(host: str) -> bool:
    """True when ``host``, however spelled (``core/hostnames.py``), names only this machine."""
    return is_loopback_host(host)


def validate_policy(policy: PolicySettings) -> None:
    if policy.engine not in POLICY_ENGINES:
        raise ConfigError("policy.engine", f"must be one of {sorted(POLICY_ENGINES)}")
    if policy.eval_timeout_ms <= 0 or policy.reload_seconds < 0:
        raise ConfigError("policy", "eval_timeout_ms must be positive, reload_seconds >= 0")
    if policy.engine == "opa":
        if policy.opa_url is None or not url_allowed(policy.opa_url):
            raise ConfigError("policy.opa_url", "engine opa needs an https URL (http on loopback)")
        return
    if policy.bundle_url is not None:
        if policy.bundle is not None:
            raise ConfigError("policy.bundle_url", "set bundle_url or bundle, not both")
        ref = policy.bundle_ref
        gcs = isinstance(ref, GcsBundleRef) and bool(ref.bucket) and bool(ref.name)
        if not (gcs or url_allowed(policy.bundle_url)):
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


def validate_audit(audit: AuditSettings) -> None:
    if audit.checkpoint_seconds <= 0 or audit.segment_bytes < 0:
        raise ConfigError("audit", "checkpoint_seconds must be positive, segment_bytes >= 0")
    if len(audit.witnesses) != len(audit.witness_keys):
        raise ConfigError("audit.witness_keys", "one key per witness URL, in the same order")
    for url in audit.witnesses:
        if not url_allowed(url):
            raise ConfigError("audit.witnesses", "https URLs (http only on loopback)")
    if audit.sink is not None and not sink_allowed(audit.sink):
        raise ConfigError("audit.sink", SINK_FORMS)


SINK_FORMS = "syslog://HOST:PORT or https://… (http on loopback)"


def sink_allowed(url: str) -> bool:
    """An audit sink URL (``[audit] sink``, ``broker audit monitor --sink``)."""
    parts = urlsplit(url)
    return (parts.scheme == "syslog" and bool(parts.hostname)) or url_allowed(url)


MAX_SVID_LIFETIME_SECONDS = 86400


def validate_identity(identity: IdentitySettings, *, attest_enabled: bool) -> None:
    """``[identity]``: a SPIFFE trust domain, a CA chain and key, a sane lifetime; on a result."""
    if not 60 <= identity.max_lifetime_seconds <= MAX_SVID_LIFETIME_SECONDS:
        raise ConfigError(
            "identity.max_lifetime_seconds", f"must be 60..{MAX_SVID_LIFETIME_SECONDS}"
        )
    if not identity.enabled:
        return
    if not attest_enabled:
        raise ConfigError("identity.enabled", "workload certificates need [attest] enabled")
    if not valid_trust_domain(identity.trust_domain):
        raise ConfigError(
            "identity.trust_domain",
            "must be a SPIFFE trust domain name: lower-case letters, digits, '.', '-', '_'",
        )
    if identity.ca_certificates is None:
        raise ConfigError("identity.ca_certificates", "identity needs the CA's certificate (PEM)")
    if identity.ca_key is None:
        raise ConfigError("identity.ca_key", "identity needs the CA's key (EC P-256)")
    _ = identity.ca_key_ref  # a malformed reference fails here, at load


def validate_attest(attest: AttestSettings, *, made_by_broker: bool = False) -> None:
    if not 1 <= attest.ttl_seconds <= MAX_EAR_TTL_SECONDS:
        raise ConfigError("attest.ttl_seconds", f"must be 1..{MAX_EAR_TTL_SECONDS}")
    if attest.enabled and attest.signing_key is None and not made_by_broker:
        raise ConfigError("attest.signing_key", "attest needs a result-signing key (EC P-256 PEM)")


def validate_nonces(nonces: NonceSettings) -> None:
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


def validate_keys(keys: KeySettings) -> None:
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


def validate_nvidia(nvidia: NvidiaSettings) -> None:
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
        if url is not None and not url_allowed(url):
            raise ConfigError(f"nvidia.{key}", "must be https (http only on loopback)")
    if nvidia.upstream_timeout_seconds <= 0 or nvidia.rim_cache_seconds <= 0:
        raise ConfigError("nvidia", "timeouts and cache lifetimes must be positive")
    if nvidia.ocsp_cache_seconds < 0:
        raise ConfigError("nvidia.ocsp_cache_seconds", "must not be negative")


def validate_tdx(tdx: TdxSettings) -> None:
    for key in ("pccs_url", "root_ca_crl_url"):
        url = getattr(tdx, key)
        if url is not None and not url_allowed(url):
            raise ConfigError(f"tdx.{key}", "must be https (http only on loopback)")
    if tdx.collateral_dir is not None and not tdx.collateral_dir.is_dir():
        raise ConfigError("tdx.collateral_dir", f"no such directory: {tdx.collateral_dir}")
    if not tdx.root_certificate.is_file():
        raise ConfigError("tdx.root_certificate", f"no such file: {tdx.root_certificate}")
    if tdx.refresh_seconds <= 0 or tdx.upstream_timeout_seconds <= 0:
        raise ConfigError("tdx", "refresh_seconds and upstream_timeout_seconds must be positive")


def validate_snp(snp: SnpSettings) -> None:
    if snp.certs_dir is not None and not snp.certs_dir.is_dir():
        raise ConfigError("snp.certs_dir", f"no such directory: {snp.certs_dir}")
    if snp.roots is not None and not snp.roots.is_file():
        raise ConfigError("snp.roots", f"no such file: {snp.roots}")
    if snp.kds_url is not None and not url_allowed(snp.kds_url):
        raise ConfigError("snp.kds_url", "must be https (http only on loopback)")
    if not 0 <= snp.max_vmpl <= 3:
        raise ConfigError("snp.max_vmpl", "must be 0 to 3")
    if snp.kds_timeout_seconds <= 0:
        raise ConfigError("snp.kds_timeout_seconds", "must be positive")


def url_allowed(url: str) -> bool:
    parts = urlsplit(url)
    return parts.scheme == "https" or (parts.scheme == "http" and is_loopback(parts.hostname or ""))


def validate_server(server: ServerSettings, *, made_by_broker: bool = False) -> None:
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
        not url_allowed(url)
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


def validate_issuer(name: str, issuer: IssuerSettings) -> None:  # noqa: PLR0912
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
    if issuer.jwks_url is not None and not url_allowed(issuer.jwks_url):
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

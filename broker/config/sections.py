"""The typed sections of the configuration: one frozen dataclass per TOML table, with the
defaults and the references each one parses once (``core/refs.py``). ``broker.config`` builds
them (``load_settings``) and ``broker.config.validation`` checks them; both names are exported
from ``broker.config``, where callers import them.
"""

from __future__ import annotations

import hmac
import re
import socket
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from urllib.parse import urlsplit

from broker.attestation.issuers import IssuerSettings
from broker.core.refs import (
    BundleRef,
    KekRef,
    SignerRef,
    StoreRef,
    bundle_ref,
    kek_ref,
    signer_ref,
    store_ref,
)

REPLICA_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


def default_replica_id() -> str:
    """The host name's first label (a pod's name on Kubernetes), or "broker" if it has none."""
    label = socket.gethostname().split(".", 1)[0]
    return label if REPLICA_ID.fullmatch(label) else "broker"


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
    # A Server-Timing header on each release answer, full evidence or on an attestation
    # result: where its time went, stage by stage (bench/release_bench.py --single,
    # bench/attested_bench.py). Off by default: a client must not learn where a decision spends
    # its time (a side channel); timings are for the operator.
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


# The Intel SGX Root CA shipped in certs/ (fingerprint in certs/README.md)
SHIPPED_INTEL_SGX_ROOT = Path(__file__).resolve().parents[1] / "shipped/certs/intel_sgx_root_ca.pem"


@dataclass(frozen=True)
class TdxSettings:
    """Raw Intel TDX quotes (issue 33): DCAP collateral from files and/or a PCS/PCCS."""

    pccs_url: str | None = None  # PCS v4 API base, e.g. https://api.trustedservices.intel.com
    root_ca_crl_url: str | None = None  # default: <pccs_url>/sgx/certification/v4/rootcacrl
    collateral_dir: Path | None = None  # dcap-qvl collateral JSON files, read first
    root_certificate: Path = SHIPPED_INTEL_SGX_ROOT  # the only trust anchor
    refresh_seconds: int = 3600  # refetch after this, or this long before a nextUpdate
    upstream_timeout_seconds: int = 10

    @property
    def enabled(self) -> bool:
        return self.pccs_url is not None or self.collateral_dir is not None


@dataclass(frozen=True)
class SnpSettings:
    """``[snp]``: AMD SEV-SNP reports the broker verifies itself (Confidential Containers guests,
    tee ``snp``; docs/evidence.md). The VCEK/VLEK comes from the guest's ``cert_chain``, then
    ``certs_dir``, then AMD's key distribution service at ``kds_url``."""

    kds_url: str | None = None  # e.g. https://kdsintf.amd.com ; unset: VCEKs are never fetched
    certs_dir: Path | None = None  # VCEKs, VLEKs, ASKs, ASVKs (DER or PEM), read at start-up
    roots: Path | None = None  # PEM of the AMD ARKs to pin; unset: certs/amd_sev_snp_roots.pem
    max_vmpl: int = 0  # a report asked for from a higher VMPL is refused (snp_vmpl_refused)
    kds_timeout_seconds: float = 10.0


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
    # The state file of a `broker audit monitor --rules` run on this host: the console's Watch
    # rules page shows its rules and last hits (docs/audit.md, "Watch rules"); unset: the page
    # says so
    watch_state: Path | None = None

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
class IdentitySettings:
    """``[identity]``: workload certificates (SPIFFE X.509-SVIDs) on attestation results,
    ``POST /v1/identity`` and the trust bundle (docs/api.md, issue 32). Off by default; needs
    ``[attest] enabled``."""

    enabled: bool = False
    trust_domain: str = ""  # e.g. "runners.example.org": SVIDs name spiffe://<this>/<path>
    # the intermediate CA: its certificate chain (PEM: the CA first, then up to the root) and its
    # key (EC P-256: a PEM path, cloudkms:…/cryptoKeyVersions/N, pkcs11:…), as [attest] signing_key
    ca_certificates: str | None = None
    ca_key: str | None = None
    # PEM files of CA certificates a rotation retired: still in the bundle until the last
    # certificate they signed expired (remove after max_lifetime_seconds)
    previous_ca_certificates: tuple[str, ...] = ()
    max_lifetime_seconds: int = 3600  # 60..86400; never past the attestation result's expiry

    @cached_property
    def ca_key_ref(self) -> SignerRef | None:
        """``ca_key`` parsed (core/refs.py), once."""
        return None if self.ca_key is None else signer_ref(self.ca_key)


@dataclass(frozen=True)
class KbsSettings:
    """``[kbs]``: the KBS protocol facade for Confidential Containers guests (docs/kbs.md,
    issue 33). Off by default; needs ``[attest] enabled`` (its tokens are attestation results)."""

    enabled: bool = False
    # DEVELOPMENT ONLY: accept the unsigned `sample` evidence a guest without a TEE sends
    # (loopback brokers only); off, it is refused with kbs_sample_refused
    allow_sample_evidence: bool = False
    session_ttl_seconds: int = 300  # a kbs-session-id cookie lives this long (10..3600)
    token_ttl_seconds: int = 300  # a guest's token (10..900; never past [attest] keys' reach)
    # the status of a policy deny: 403 (the guest stops) or 401 (as Trustee: the guest runs
    # the handshake again, up to 3 times per resource); logged either way
    deny_status: int = 403
    # POST /kbs/v0/auth per client address and worker, on top of [server] rate_limit_per_ip:
    # requests per second (0: off), bursts of auth_rate_burst; past it 429 (ErrorInformation).
    # Every handshake is a record (~540 bytes): this bounds what one address adds to the log
    auth_rate_per_ip: float = 10.0
    auth_rate_burst: int = 20
    # [kbs.resources] "<repository>/<type>/<tag>" = "<key name>" or "<key name>@<version>";
    # a path outside it is 404 (parsed by ``load_settings``, not from the environment)
    resources: tuple[tuple[str, str, int | None], ...] = ()


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
    snp: SnpSettings = field(default_factory=SnpSettings)
    admin: AdminSettings = field(default_factory=AdminSettings)
    nonces: NonceSettings = field(default_factory=NonceSettings)
    attest: AttestSettings = field(default_factory=AttestSettings)
    identity: IdentitySettings = field(default_factory=IdentitySettings)
    sealed: SealedSettings = field(default_factory=SealedSettings)
    kbs: KbsSettings = field(default_factory=KbsSettings)
    tdx: TdxSettings = field(default_factory=TdxSettings)


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

"""One typed configuration, loaded from TOML plus ``BROKER_…`` environment overrides.

Loaded and validated once at start-up; a bad value raises ``ConfigError`` naming the key (the CLI
prints it and exits non-zero). Relative paths are resolved against the directory of the config
file, so a config file and the files it names can move together.

Environment overrides: ``BROKER_<SECTION>_<KEY>`` (upper case) replaces ``[section] key``, e.g.
``BROKER_SERVER_LISTEN=127.0.0.1:9443`` or ``BROKER_KEYS_KEK=local:/srv/kek.key``. The
``[[issuers]]`` list has no environment form: trust anchors come from the file only.

This module reads and builds; the sections are declared in ``sections.py``, each section's own
checks live in ``checks.py`` and the rules across sections in ``validation.py``. Import every
name from ``broker.config``, which exports them all.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from broker.attestation.issuers import IssuerSettings
from broker.config.checks import (
    ALLOWED_TOKEN_ALGORITHMS,
    EVENT_LOOPS,
    ISSUER_KINDS,
    KEY_STORE_FORMS,
    MAX_EAR_TTL_SECONDS,
    MAX_WORKERS,
    POLICY_ENGINES,
    TOKEN_TYPES,
    is_loopback,
    key_store_ref,
)
from broker.config.kbs import kbs_settings
from broker.config.sections import (
    ADMIN_ROLES,
    NONCE_STORE_FORMS,
    REPLICA_ID,
    AdminSettings,
    AttestSettings,
    AuditSettings,
    IdentitySettings,
    KbsSettings,
    KeySettings,
    NonceSettings,
    NvidiaSettings,
    PolicySettings,
    SealedSettings,
    ServerSettings,
    Settings,
    SnpSettings,
    TdxSettings,
    default_replica_id,
    split_listen,
)
from broker.config.tables import (
    config_table,
    convert_value,
    resolve_local_kek,
    resolve_path,
    resolve_sqlite_store,
    resolve_sqlite_uri,
)
from broker.config.validation import (
    is_development_issuer,
    makes_keys,
    origin_prefix,
    validate_settings,
)
from broker.core.errors import ConfigError, FileFormatError
from broker.core.refs import LocalFileRef, SqliteRef, store_ref

__all__ = [
    "ADMIN_ROLES",
    "ALLOWED_TOKEN_ALGORITHMS",
    "EVENT_LOOPS",
    "ISSUER_KINDS",
    "KEY_STORE_FORMS",
    "MAX_EAR_TTL_SECONDS",
    "MAX_WORKERS",
    "NONCE_STORE_FORMS",
    "POLICY_ENGINES",
    "REPLICA_ID",
    "TOKEN_TYPES",
    "AdminSettings",
    "AttestSettings",
    "IdentitySettings",
    "KbsSettings",
    "AuditSettings",
    "KeySettings",
    "NonceSettings",
    "NvidiaSettings",
    "SnpSettings",
    "PolicySettings",
    "SealedSettings",
    "ServerSettings",
    "Settings",
    "TdxSettings",
    "default_replica_id",
    "is_development_issuer",
    "is_loopback",
    "key_store_ref",
    "load_settings",
    "makes_keys",
    "nonce_store_setting",
    "origin_prefix",
    "replica_origin",
    "settings_from_mapping",
    "split_listen",
]


def nonce_store_setting(store: str) -> str:
    """A resolved ``[nonces] store`` as it must be written to be read back unchanged (a resolved
    SQLite path is absolute: ``sqlite:///`` followed by ``/…``)."""
    ref = store_ref(store, "nonces.store")
    return f"sqlite:///{ref.path}" if isinstance(ref, SqliteRef) else store


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
        "snp",
        "admin",
        "nonces",
        "attest",
        "identity",
        "sealed",
        "kbs",
        "tdx",
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
    snp = config_table(SnpSettings, "snp", raw, env, base_dir)
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
    identity = _identity_resolved(
        config_table(IdentitySettings, "identity", raw, env, base_dir), base_dir
    )
    sealed = config_table(SealedSettings, "sealed", raw, env, base_dir)
    tdx = config_table(TdxSettings, "tdx", raw, env, base_dir)
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
        snp=snp,
        admin=admin,
        nonces=nonces,
        attest=attest,
        identity=identity,
        kbs=kbs_settings(raw, env, base_dir),
        tdx=tdx,
    )
    validate_settings(settings)
    return settings


def _identity_resolved(identity: IdentitySettings, base_dir: Path) -> IdentitySettings:
    """``[identity]``'s files made absolute against the config file's directory."""
    ca_key = identity.ca_key
    if isinstance(identity.ca_key_ref, LocalFileRef):
        ca_key = str(resolve_path(base_dir, identity.ca_key_ref.uri))
    chain = identity.ca_certificates
    return replace(
        identity,
        ca_key=ca_key,
        ca_certificates=None if chain is None else str(resolve_path(base_dir, chain)),
        previous_ca_certificates=tuple(
            str(resolve_path(base_dir, p)) for p in identity.previous_ca_certificates
        ),
    )


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

"""Typed references: what a store URI, a KEK URI, a signing-key setting or a bundle URL names.

The configuration holds these as the strings an operator writes (``sqlite:///keys.db``,
``cloudkms:projects/…``, ``pkcs11:token=…``, ``gs://bucket/object``). They are parsed here, once
(the configuration exposes each parsed value: ``KeySettings.kek_refs`` & co.), and every user
matches on the type instead of re-reading prefixes. ``uri`` is always the text as written (what
``/readyz`` and error messages show, with no credential: ``kind`` for stores).

Parsing checks the form only (a scheme and something after it); each backend still validates its
own syntax (a Cloud KMS key name, a PKCS#11 URI's attributes) where it is opened.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from broker.core.errors import ConfigError

# ---- stores: spent nonces, attestation results ([nonces] store) and keys ([keys] store)


@dataclass(frozen=True)
class MemoryRef:
    uri: str = "memory"
    kind: Literal["memory"] = "memory"


@dataclass(frozen=True)
class SqliteRef:
    uri: str
    path: Path
    kind: Literal["sqlite"] = "sqlite"


@dataclass(frozen=True)
class RedisRef:
    uri: str
    kind: Literal["redis"] = "redis"


@dataclass(frozen=True)
class PostgresRef:
    uri: str
    kind: Literal["postgresql"] = "postgresql"


@dataclass(frozen=True)
class SecretManagerRef:
    uri: str
    kind: Literal["secretmanager"] = "secretmanager"


StoreRef = MemoryRef | SqliteRef | RedisRef | PostgresRef | SecretManagerRef

# ---- keys: KEKs ([keys] kek, kek_previous) and signing keys ([audit]/[attest] signing_key)


@dataclass(frozen=True)
class LocalFileRef:
    """A key in a local file: a development KEK (``local:PATH``) or a PEM signing key."""

    uri: str
    path: Path
    kind: Literal["file"] = "file"


@dataclass(frozen=True)
class Pkcs11Ref:
    uri: str
    kind: Literal["pkcs11"] = "pkcs11"


@dataclass(frozen=True)
class CloudKmsRef:
    uri: str
    kind: Literal["cloudkms"] = "cloudkms"


KekRef = LocalFileRef | Pkcs11Ref | CloudKmsRef
SignerRef = LocalFileRef | Pkcs11Ref | CloudKmsRef

# ---- policy bundles ([policy] bundle_url)


@dataclass(frozen=True)
class HttpBundleRef:
    uri: str
    kind: Literal["https"] = "https"


@dataclass(frozen=True)
class GcsBundleRef:
    uri: str
    bucket: str
    name: str
    kind: Literal["gs"] = "gs"


BundleRef = HttpBundleRef | GcsBundleRef

KEK_FORMS = "expected local:PATH, pkcs11:… or cloudkms:projects/…"
STORE_FORMS = (
    "expected memory, sqlite:///PATH, redis://HOST:PORT/DB, postgresql://USER@HOST/DB "
    "or secretmanager:projects/P"
)


def store_ref(uri: str, setting: str) -> StoreRef:
    """Raises: ConfigError naming ``setting`` for a form no store has."""
    if uri == "memory":
        return MemoryRef()
    if uri.startswith("sqlite:///") and len(uri) > len("sqlite:///"):
        # sqlite:////abs (a resolved [keys] store) and sqlite:///abs (a resolved [nonces]
        # store) name the same file: /abs, not //abs
        return SqliteRef(uri, Path("/" + uri.removeprefix("sqlite:///").lstrip("/")))
    if uri.startswith(("redis://", "rediss://")):
        return RedisRef(uri)
    if uri.startswith(("postgresql://", "postgres://")):
        return PostgresRef(uri)
    if uri.startswith("secretmanager:projects/") and len(uri) > len("secretmanager:projects/"):
        return SecretManagerRef(uri)
    raise ConfigError(setting, STORE_FORMS)


def kek_ref(uri: str, setting: str) -> KekRef:
    """Raises: ConfigError naming ``setting`` unless ``local:PATH``, ``pkcs11:…`` or
    ``cloudkms:…``."""
    scheme, colon, rest = uri.partition(":")
    if not colon or not rest:
        raise ConfigError(setting, KEK_FORMS)
    if scheme == "local":
        return LocalFileRef(uri, Path(rest))
    if scheme == "pkcs11":
        return Pkcs11Ref(uri)
    if scheme == "cloudkms":
        return CloudKmsRef(uri)
    raise ConfigError(setting, KEK_FORMS)


def signer_ref(value: str) -> SignerRef:
    """A signing key: ``cloudkms:…``, ``pkcs11:…``, or else a PEM file's path."""
    if value.startswith("cloudkms:"):
        return CloudKmsRef(value)
    if value.startswith("pkcs11:"):
        return Pkcs11Ref(value)
    return LocalFileRef(value, Path(value))


def bundle_ref(url: str) -> BundleRef:
    """``gs://BUCKET/OBJECT`` or an HTTP(S) URL (the configuration checks which it allows)."""
    if url.startswith("gs://"):
        bucket, _, name = url.removeprefix("gs://").partition("/")
        return GcsBundleRef(url, bucket, name)
    return HttpBundleRef(url)

"""Typed references (``broker/core/refs.py``): each configured store, KEK, signing key and bundle
string is parsed in one place, and no other module re-reads its prefix."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from broker.core.errors import ConfigError
from broker.core.refs import (
    CloudKmsRef,
    GcsBundleRef,
    HttpBundleRef,
    LocalFileRef,
    MemoryRef,
    Pkcs11Ref,
    PostgresRef,
    RedisRef,
    SecretManagerRef,
    SqliteRef,
    bundle_ref,
    kek_ref,
    signer_ref,
    store_ref,
)

BROKER = Path(__file__).resolve().parents[2] / "broker"
# A backend checks its own syntax where it is opened (a KMS key name, a PKCS#11 URI, a project);
# the SDK and the weights CLI read storage URLs (not configuration references).
OWN_SYNTAX = {
    "core/refs.py",
    "keys/kek/cloudkms.py",
    "keys/kek/pkcs11.py",
    "keys/store/secretmanager.py",
    "cloud/kms_key.py",
    "cloud/storage_upload.py",
    "client/weights.py",
    "cli/weights.py",
    "config/tables.py",  # path resolution of the raw strings, before they are parsed
}
PREFIX = re.compile(
    r"""(startswith|removeprefix)\(\(?["'](cloudkms|pkcs11|local|sqlite|redis|rediss|"""
    r"""postgres|postgresql|secretmanager|gs):"""
)


@pytest.mark.parametrize(
    ("uri", "kind"),
    [
        ("memory", MemoryRef),
        ("sqlite:////var/lib/broker/nonces.db", SqliteRef),
        ("redis://cache:6379/0", RedisRef),
        ("rediss://cache:6380/0", RedisRef),
        ("postgresql://broker@db/broker", PostgresRef),
        ("postgres://broker@db/broker", PostgresRef),
        ("secretmanager:projects/p", SecretManagerRef),
    ],
)
def test_store_forms(uri: str, kind: type) -> None:
    ref = store_ref(uri, "nonces.store")
    assert isinstance(ref, kind)
    assert ref.uri == uri


def test_a_sqlite_store_names_its_absolute_path() -> None:
    ref = store_ref("sqlite:///var/lib/broker/nonces.db", "nonces.store")  # as resolved
    assert isinstance(ref, SqliteRef)
    assert ref.path == Path("/var/lib/broker/nonces.db")


@pytest.mark.parametrize("uri", ["", "sqlite:///", "mysql://db/x", "memory:", "file:x"])
def test_malformed_store_names_its_setting(uri: str) -> None:
    with pytest.raises(ConfigError) as caught:
        store_ref(uri, "keys.store")
    assert caught.value.key == "keys.store"


def test_kek_forms() -> None:
    local = kek_ref("local:/srv/kek.key", "keys.kek")
    assert isinstance(local, LocalFileRef)
    assert local.path == Path("/srv/kek.key")
    assert isinstance(kek_ref("pkcs11:token=t;object=k", "keys.kek"), Pkcs11Ref)
    assert isinstance(
        kek_ref("cloudkms:projects/p/locations/l/keyRings/r/cryptoKeys/k", "k"), CloudKmsRef
    )
    for bad in ("local:", "vault:x", "kek.key"):
        with pytest.raises(ConfigError):
            kek_ref(bad, "keys.kek_previous[0]")


def test_signer_and_bundle_forms() -> None:
    assert isinstance(signer_ref("cloudkms:projects/p/x/cryptoKeyVersions/1"), CloudKmsRef)
    assert isinstance(signer_ref("pkcs11:token=t;object=r"), Pkcs11Ref)
    assert signer_ref("/etc/broker/log.pem") == LocalFileRef(
        "/etc/broker/log.pem", Path("/etc/broker/log.pem")
    )
    gcs = bundle_ref("gs://bucket/dir/prod.tar.gz")
    assert isinstance(gcs, GcsBundleRef)
    assert (gcs.bucket, gcs.name) == ("bucket", "dir/prod.tar.gz")
    assert isinstance(bundle_ref("https://bundles.internal/prod.tar.gz"), HttpBundleRef)


def test_no_module_rereads_a_reference_prefix() -> None:
    """Matched on by type (``isinstance`` on a ``*Ref``), never by ``startswith("cloudkms:")``."""
    found = []
    for path in sorted(BROKER.rglob("*.py")):
        relative = path.relative_to(BROKER).as_posix()
        if relative in OWN_SYNTAX:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if PREFIX.search(line):
                found.append(f"{relative}:{number}: {line.strip()}")
    assert not found, "parse it once in core/refs.py and match on the type:\n" + "\n".join(found)

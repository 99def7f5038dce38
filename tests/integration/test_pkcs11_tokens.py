"""Several KEKs on one PKCS#11 token (SoftHSM2): one login per token per process, duplicate
labels refused, ambiguous labels named, fingerprints of key objects."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pkcs11
import pytest
from pkcs11 import KeyType

from broker.config import KeySettings
from broker.core.errors import ConfigError
from broker.keys.factory import open_key_service
from broker.keys.kek.pkcs11 import Pkcs11Kek, Pkcs11Uri, create_pkcs11_kek, parse_pkcs11_uri
from broker.keys.store.base import Purpose
from tests.integration.conftest import HSM_PIN, SOFTHSM_MODULE
from tests.support.cli import run


@pytest.fixture
def token(softhsm: str) -> str:
    """The session's SoftHSM2 token, as a URI template with a fresh ``{object}`` prefix per
    test (SoftHSM2 does not show tokens initialised after the library was loaded)."""
    prefix = "t" + uuid.uuid4().hex[:8] + "-"
    return softhsm.replace("object=kek", "object=" + prefix + "{object}")


def parse(uri: str) -> Pkcs11Uri:
    return parse_pkcs11_uri(uri)


def uri_for(template: str, name: str) -> str:
    return template.replace("{object}", name)


def label(template: str, name: str) -> str:
    return parse_pkcs11_uri(uri_for(template, name)).object


async def test_two_keks_on_one_token_open_at_once(token: str) -> None:
    first, second = uri_for(token, "kek-a"), uri_for(token, "kek-b")
    parsed = [await asyncio.to_thread(parse, uri) for uri in (first, second)]
    for uri in parsed:
        await asyncio.to_thread(create_pkcs11_kek, uri)
    a, b = Pkcs11Kek(parsed[0]), Pkcs11Kek(parsed[1])
    await a.open()
    await b.open()  # used to fail: UserAlreadyLoggedIn
    try:
        wrapped_a = await a.wrap(b"\x01" * 32, b"aad")
        wrapped_b = await b.wrap(b"\x02" * 32, b"aad")
        assert await a.unwrap(wrapped_a, b"aad") == b"\x01" * 32
        assert await b.unwrap(wrapped_b, b"aad") == b"\x02" * 32
        await a.close()
        assert await b.unwrap(wrapped_b, b"aad") == b"\x02" * 32  # the shared session lives on
    finally:
        await a.close()
        await b.close()


async def test_rotation_between_hsm_keys_on_one_token(token: str, tmp_path: Path) -> None:
    old, new = uri_for(token, "kek-2025"), uri_for(token, "kek-2026")
    for uri in (old, new):
        await asyncio.to_thread(create_pkcs11_kek, await asyncio.to_thread(parse, uri))
    store = f"sqlite:///{tmp_path / 'keys.db'}"
    now = datetime.now(UTC)
    async with open_key_service(KeySettings(store=store, kek=old)) as keys:
        record = await keys.create("models/rotating", Purpose.MODEL_WEIGHTS, now=now)
        dek = await keys.unwrap(record)
    # The normal rotation: the new key is primary, the old one stays for unwrapping.
    rotated = KeySettings(store=store, kek=new, kek_previous=(old,))
    async with open_key_service(rotated) as keys:
        assert await keys.unwrap(await keys.resolve("models/rotating", None)) == dek
        fresh = await keys.rotate("models/rotating", now=now)
        assert fresh.kek_ref.endswith("-kek-2026")


def test_duplicate_kek_label_refused(token: str) -> None:
    uri = parse_pkcs11_uri(uri_for(token, "kek"))
    create_pkcs11_kek(uri)
    with pytest.raises(ConfigError) as caught:
        create_pkcs11_kek(uri)
    assert "already exists" in caught.value.message


def test_kek_create_twice_on_the_cli_is_a_clear_error(token: str) -> None:
    uri = uri_for(token, "kek")
    first = run("keys", "kek-create", uri)
    assert first.returncode == 0, first.stderr
    second = run("keys", "kek-create", uri)
    assert second.returncode == 2
    assert "already exists" in second.stderr
    assert "Traceback" not in second.stderr


async def test_ambiguous_label_names_the_matching_ids(token: str) -> None:
    uri = await asyncio.to_thread(parse, uri_for(token, "twin"))

    def make_twins() -> None:  # two objects under one label, made around our refusal
        with (
            pkcs11.lib(str(SOFTHSM_MODULE))
            .get_token(token_label=uri.token)
            .open(user_pin=HSM_PIN, rw=True) as session
        ):
            for ident in (b"\xaa", b"\xbb"):
                session.generate_key(
                    KeyType.AES,
                    256,
                    label=uri.object,
                    id=ident,
                    store=True,
                    template={
                        pkcs11.Attribute.SENSITIVE: True,
                        pkcs11.Attribute.EXTRACTABLE: False,
                    },
                )

    await asyncio.to_thread(make_twins)
    kek = Pkcs11Kek(uri)
    with pytest.raises(ConfigError) as caught:
        await kek.open()
    assert "aa, bb" in caught.value.message
    assert "id=" in caught.value.message
    with_id = uri_for(token, "twin").replace(f";object={uri.object}", f";object={uri.object};id=bb")
    chosen = Pkcs11Kek(await asyncio.to_thread(parse, with_id))
    await chosen.open()  # naming the id resolves it
    await chosen.close()


def test_fingerprint_identifies_the_key_object_not_its_label(token: str) -> None:
    uri = parse_pkcs11_uri(uri_for(token, "kek-x"))
    first = create_pkcs11_kek(uri)
    with (
        pkcs11.lib(str(SOFTHSM_MODULE))
        .get_token(token_label=uri.token)
        .open(user_pin=HSM_PIN, rw=True) as session
    ):  # destroy it; a new key under the same label is another object
        for obj in session.get_objects({pkcs11.Attribute.LABEL: uri.object}):
            obj.destroy()
    second = create_pkcs11_kek(uri)
    assert first != second
    assert len(first) == len(second) == 16

"""DEKs that never leave the HSM (``pkcs11:…&x-hsm-rewrap=true``) on a real SoftHSM2 token:
made in the token, released by it to an RSA runner key through the real HTTP broker, recovered
by the runner SDK; never seen by the broker's Python code; refused for other runner keys, when
changed, or when copied to another version. docs/keys.md, "DEKs that never leave the HSM"."""

from __future__ import annotations

import asyncio
import io
import json
import sqlite3
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import pkcs11
import pytest
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from jwcrypto import jwe as jwcrypto_jwe
from jwcrypto import jwk as jwcrypto_jwk
from pkcs11 import KeyType, Mechanism, ObjectClass
from pkcs11.util.ec import encode_named_curve_parameters

from broker.client import BrokerClientError
from broker.client.unwrap import unwrap_release
from broker.client.weights import decrypt_to
from broker.config import KeySettings
from broker.core.encoding import b64url_decode, b64url_encode
from broker.core.errors import ConfigError, ErrorCode, KeyUnavailable, UpstreamError
from broker.crypto import jwe_cek
from broker.crypto.jwe import JweError
from broker.crypto.jwk import parse_runner_key, public_jwk
from broker.crypto.weights import encrypt_stream
from broker.keys.custody import custody_of, release_from_custody
from broker.keys.factory import open_key_service
from broker.keys.kek.base import dek_aad
from broker.keys.kek.pkcs11 import (
    Pkcs11Kek,
    create_pkcs11_kek,
    parse_pkcs11_uri,
)
from broker.keys.store.base import KeyVersionRecord, Purpose
from tests.integration.attested import attest_broker
from tests.integration.conftest import RunningBroker
from tests.support.cli import run
from tests.support.constants import KEY
from tests.support.hsm_custody import (
    PlaintextSpy,
    on_token,
    read_out_of_the_token,
    session_objects,
)

NOW = datetime(2026, 11, 30, tzinfo=UTC)
CKM_HKDF_DERIVE = 0x402A  # PKCS#11 3.0; what HPKE's key schedule would need in the token


async def new_kek(softhsm: str, *, custody: bool = True) -> str:
    """A fresh KEK on the session's token (``x-hsm-rewrap=true``: a derive-only one)."""
    label = ("custody-" if custody else "gcm-") + uuid.uuid4().hex[:8]
    uri = softhsm.replace("object=kek", "object=" + label)
    uri += "&x-hsm-rewrap=true" if custody else ""
    await asyncio.to_thread(lambda: create_pkcs11_kek(parse_pkcs11_uri(uri)))
    return uri


async def start_on(start_broker: Callable[..., Any], kek: str, **environ: str) -> RunningBroker:
    broker: RunningBroker = await start_broker(
        environ={"BROKER_KEYS_KEK": kek, "BROKER_KEYS_METADATA_CACHE_SECONDS": "0", **environ}
    )
    return broker


def store_of(broker: RunningBroker) -> Path:
    return Path(broker.settings.keys.store.removeprefix("sqlite:///"))


def stored(broker: RunningBroker, name: str = KEY, version: int = 1) -> bytes:
    with sqlite3.connect(store_of(broker)) as db:
        (wrapped,) = db.execute(
            "SELECT wrapped_dek FROM key_versions WHERE name = ? AND version = ?", (name, version)
        ).fetchone()
    return bytes(wrapped)


# --- through the real HTTP broker -----------------------------------------------------------


async def test_dek_made_in_the_hsm_reaches_the_runner_and_opens_its_weights(
    start_broker: Callable[..., Any], softhsm: str, tmp_path: Path
) -> None:
    kek = await new_kek(softhsm)
    broker = await start_on(start_broker, kek)
    async with broker.client() as client:
        first = await client.release(
            KEY, broker.token_source(), key_type="RSA-3072", wrap="jwe-cek"
        )
        again = await client.release(
            KEY, broker.token_source(), key_type="RSA-3072", wrap="jwe-cek"
        )
    wrapped = await asyncio.to_thread(stored, broker)
    assert wrapped[:1] == b"\x03"
    assert len(wrapped) == 41
    in_token = await asyncio.to_thread(read_out_of_the_token, kek, KEY, 1, wrapped)
    assert first.dek == again.dek == in_token  # the runner holds the token's DEK
    weights, out = tmp_path / "weights.bin", tmp_path / "weights.out"
    plain = b"layer-0" * 40_000

    def seal_weights() -> None:  # the owner, who brought this DEK
        with io.BytesIO(plain) as source, weights.open("wb") as sink:
            encrypt_stream(in_token, f"{KEY}#1", source, sink, segment_size=64 * 1024)

    await asyncio.to_thread(seal_weights)
    assert await decrypt_to(weights, out, first.dek, f"{KEY}#1") == len(plain)
    assert await asyncio.to_thread(out.read_bytes) == plain
    records = [r for r in broker.records() if r["type"] == "release"]
    assert [(r["result"], r["wrap"]) for r in records] == [("allow", "jwe-cek")] * 2


@pytest.mark.parametrize("custody", [True, False], ids=["hsm-rewrap", "control-gcm-kek"])
async def test_the_broker_never_holds_a_dek_in_custody(
    start_broker: Callable[..., Any], softhsm: str, custody: bool
) -> None:
    """Watched around a release, on the loop and on the token's thread. The control (a KEK
    without x-hsm-rewrap, DEK cache on) shows the spy sees the DEK when the broker's code holds
    it; in custody it never does."""
    kek = await new_kek(softhsm, custody=custody)
    broker = await start_on(start_broker, kek, BROKER_KEYS_DEK_CACHE_SECONDS="60")
    spy = PlaintextSpy()
    async with broker.client() as client:
        with spy.watching(kek):
            released = await client.release(
                KEY, broker.token_source(), key_type="RSA-3072", wrap="jwe-cek"
            )
    assert len(spy.seen) > 100  # the spy watched the release (evidence, policy, log, wrap)
    assert any(name.startswith("pkcs11") for name in spy.threads)  # and the token's thread
    assert spy.saw(released.dek) is not custody
    async with open_key_service(broker.settings.keys) as keys:
        record = await keys.resolve(KEY, 1)
        if custody:  # and nothing in the key service hands it out either
            with pytest.raises(KeyUnavailable) as caught:
                await keys.unwrap(record)
            assert "HSM custody" in caught.value.message
            with pytest.raises(KeyUnavailable):
                await keys.owner_material(KEY, 1, action="weights-encrypt", detail={}, now=NOW)
            aad = dek_aad(KEY, 1)
            with pytest.raises(UpstreamError):  # the KEK's only bytes-returning method
                await keys.kek.unwrap(record.wrapped_dek, aad)
            with pytest.raises(UpstreamError):  # … even with the secret format byte
                await keys.kek.unwrap(b"\x04" + record.wrapped_dek[1:], aad)


@pytest.mark.parametrize(
    ("key_type", "wrap", "custody_detail"),
    [
        ("EC-P256", "jwe", True),
        ("X25519", "hpke", True),
        ("RSA-3072", "jwe", True),  # an RSA key, but the wrap an old runner asks for
        ("EC-P256", "jwe-cek", False),  # refused as the request is parsed
    ],
)
async def test_runner_key_the_token_cannot_wrap_to_is_refused(
    start_broker: Callable[..., Any],
    softhsm: str,
    key_type: str,
    wrap: str,
    custody_detail: bool,
) -> None:
    broker = await start_on(start_broker, await new_kek(softhsm))
    async with broker.client() as client:
        with pytest.raises(BrokerClientError) as caught:
            await client.release(KEY, broker.token_source(), key_type=key_type, wrap=wrap)
    assert (caught.value.status, caught.value.code) == (400, "runner_key_invalid")
    assert (caught.value.details.get("custody") == "hsm") is custody_detail
    record = broker.records()[-1]
    assert (record["result"], record["code"]) == ("deny", "runner_key_invalid")


async def test_changed_wrapped_dek_is_refused_and_nothing_released(
    start_broker: Callable[..., Any], softhsm: str
) -> None:
    broker = await start_on(start_broker, await new_kek(softhsm))
    wrapped = bytearray(await asyncio.to_thread(stored, broker))
    wrapped[20] ^= 0x01

    def tamper() -> None:
        with sqlite3.connect(store_of(broker)) as db:
            db.execute(
                "UPDATE key_versions SET wrapped_dek = ? WHERE name = ?", (bytes(wrapped), KEY)
            )

    await asyncio.to_thread(tamper)
    async with broker.client() as client:
        with pytest.raises(BrokerClientError) as caught:
            await client.release(KEY, broker.token_source(), key_type="RSA-3072", wrap="jwe-cek")
    assert (caught.value.status, caught.value.code) == (503, "kek_unavailable")
    assert "wrapped_key" not in caught.value.details
    record = broker.records()[-1]
    assert (record["result"], record["code"]) == ("error", "kek_unavailable")


async def test_release_on_an_attestation_result_from_custody(
    start_broker: Callable[..., Any], softhsm: str
) -> None:
    kek = await new_kek(softhsm)
    broker = await attest_broker(
        start_broker, environ={"BROKER_KEYS_KEK": kek, "BROKER_KEYS_METADATA_CACHE_SECONDS": "0"}
    )
    async with broker.client() as client:
        attestation = await client.attest(
            broker.token_source(), key_type="RSA-3072", wrap="jwe-cek"
        )
        released = await attestation.release(KEY)
    wrapped = await asyncio.to_thread(stored, broker)
    assert released.dek == await asyncio.to_thread(read_out_of_the_token, kek, KEY, 1, wrapped)


# --- the key service and the KEK, directly --------------------------------------------------


def runner_key() -> tuple[rsa.RSAPrivateKey, Any]:
    private = rsa.generate_private_key(public_exponent=65537, key_size=3072)
    return private, parse_runner_key(public_jwk(private.public_key()))


async def custody_release(keys: Any, record: KeyVersionRecord, key: Any) -> str:
    custody = custody_of(keys.keks.for_ref(record.kek_ref), record.purpose)
    assert custody is not None
    return await release_from_custody(custody, record, key, decision_id="d-1")


async def test_wrapped_dek_copied_onto_another_version_is_refused(
    tmp_path: Path, softhsm: str
) -> None:
    kek = await new_kek(softhsm)
    settings = KeySettings(store=f"sqlite:///{tmp_path / 'keys.db'}", kek=kek)
    private, key = await asyncio.to_thread(runner_key)
    async with open_key_service(settings) as keys:
        before = await asyncio.to_thread(session_objects, kek)
        a = await keys.create("models/a", Purpose.MODEL_WEIGHTS, now=NOW)
        b = await keys.create("models/b", Purpose.MODEL_WEIGHTS, now=NOW)
        token = await custody_release(keys, a, key)  # the original opens
        expected = jwe_cek.CekRelease("models/a", 1, "d-1")
        assert len(jwe_cek.open_release(token, private, expected)) == 32
        swapped = b.evolve(wrapped_dek=a.wrapped_dek)  # what a writer of the store could do
        with pytest.raises(UpstreamError) as caught:
            await custody_release(keys, swapped, key)
        assert caught.value.code is ErrorCode.KEK_UNAVAILABLE
        assert "another version" in caught.value.message
        # every DEK, wrapping key and runner key made on the way was destroyed, failure or not
        assert await asyncio.to_thread(session_objects, kek) == before


def test_runner_refuses_a_jwe_cek_for_another_release() -> None:
    """The SDK's side, in software: the statement and header bind key, version, decision."""
    private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    dek = bytes(range(32))
    made = jwe_cek.CekRelease(KEY, 2, "d-1", "sha256:p")
    token = jwe_cek.encrypt(dek, private.public_key(), made)
    assert jwe_cek.open_release(token, private, made) == dek
    for other in (
        jwe_cek.CekRelease(KEY, 1, "d-1", "sha256:p"),
        jwe_cek.CekRelease(KEY, 2, "d-2", "sha256:p"),
        jwe_cek.CekRelease(KEY, 2, "d-1", None),
        jwe_cek.CekRelease("models/other", 2, "d-1", "sha256:p"),
    ):
        with pytest.raises(JweError):
            jwe_cek.open_release(token, private, other)
    header, *parts = token.split(".")
    same_members = json.dumps(json.loads(b64url_decode(header)), sort_keys=True).encode()
    reordered = ".".join([b64url_encode(same_members), *parts])  # only the AAD tells
    with pytest.raises(JweError, match="does not authenticate"):
        jwe_cek.open_release(reordered, private, made)
    body = {"key": KEY, "version": 2, "decision_id": "d-1", "wrapped_key": token, "wrap": "jwe"}
    with pytest.raises(JweError):  # asked for jwe-cek, answered as another wrap
        unwrap_release(body, private, expected_key=KEY, expected_version=2, expected_wrap="jwe-cek")


async def test_jwe_cek_made_by_the_token_is_a_standard_jwe(tmp_path: Path, softhsm: str) -> None:
    """jwcrypto (another implementation) opens it with the runner's key: its CEK is the DEK."""
    kek = await new_kek(softhsm)
    settings = KeySettings(store=f"sqlite:///{tmp_path / 'keys.db'}", kek=kek)
    private, key = await asyncio.to_thread(runner_key)
    async with open_key_service(settings) as keys:
        record = await keys.create(KEY, Purpose.GENERIC, now=NOW)
        token = await custody_release(keys, record, key)
    opened = jwcrypto_jwe.JWE()
    opened.deserialize(token, key=jwcrypto_jwk.JWK.from_pyca(private))
    assert opened.payload == jwe_cek.CekRelease(KEY, 1, "d-1").statement()
    assert opened.jose_header["alg"] == jwe_cek.RSA_OAEP  # what SoftHSM2 2.6.1 can make
    dek = await asyncio.to_thread(read_out_of_the_token, kek, KEY, 1, record.wrapped_dek)
    assert jwe_cek.open_release(token, private, jwe_cek.CekRelease(KEY, 1, "d-1")) == dek


async def test_rotation_moves_dek_inside_the_token_and_never_out(
    tmp_path: Path, softhsm: str
) -> None:
    store = f"sqlite:///{tmp_path / 'keys.db'}"
    gcm = await new_kek(softhsm, custody=False)
    first, second = await new_kek(softhsm), await new_kek(softhsm)
    async with open_key_service(KeySettings(store=store, kek=gcm)) as keys:  # before custody
        brought = await keys.unwrap(await keys.create("models/old", Purpose.MODEL_WEIGHTS, now=NOW))
    async with open_key_service(KeySettings(store=store, kek=first, kek_previous=(gcm,))) as keys:
        made = await keys.create("models/new", Purpose.MODEL_WEIGHTS, now=NOW)
        assert (await keys.rewrap(now=NOW)).rewrapped == 1  # GCM -> custody (an import)
    rotated = KeySettings(store=store, kek=second, kek_previous=(first,))
    async with open_key_service(rotated) as keys:
        assert (await keys.rewrap(now=NOW)).rewrapped == 2  # custody -> custody, in the token
        moved = {r.name: r for r in await keys.list_versions()}
    target = await asyncio.to_thread(parse_pkcs11_uri, second)
    assert {r.kek_ref for r in moved.values()} == {target.reference}
    old_dek, new_dek = [
        await asyncio.to_thread(read_out_of_the_token, second, name, 1, moved[name].wrapped_dek)
        for name in ("models/old", "models/new")
    ]
    assert old_dek == brought  # imported into custody, then moved inside the token
    assert new_dek != brought
    assert len(new_dek) == 32
    assert made.wrapped_dek[:1] == b"\x03"
    out = KeySettings(store=store, kek=gcm, kek_previous=(second,))
    async with open_key_service(out) as keys:
        with pytest.raises(KeyUnavailable) as caught:
            await keys.rewrap(now=NOW)
        assert "same token" in caught.value.message


async def test_secrets_that_are_not_deks_still_seal_under_a_custody_kek(
    tmp_path: Path, softhsm: str
) -> None:
    """The sealed broker's own keys and query keys (the token has no HPKE) use wrap/unwrap."""
    kek = Pkcs11Kek(await asyncio.to_thread(parse_pkcs11_uri, await new_kek(softhsm)))
    await kek.open()
    try:
        sealed = await kek.wrap(b"a private key in DER" * 8, b"role")
        assert sealed[:1] == b"\x04"
        assert await kek.unwrap(sealed, b"role") == b"a private key in DER" * 8
        with pytest.raises(UpstreamError):
            await kek.unwrap(sealed, b"another role")
    finally:
        await kek.close()


async def test_kek_and_mode_must_match(softhsm: str) -> None:
    gcm = await new_kek(softhsm, custody=False)
    custody = softhsm.replace("object=kek", "object=cli-" + uuid.uuid4().hex[:8])
    custody += "&x-hsm-rewrap=true"
    made = await asyncio.to_thread(run, "keys", "kek-create", custody)
    assert made.returncode == 0, made.stderr
    kek = Pkcs11Kek(await asyncio.to_thread(parse_pkcs11_uri, custody))
    await kek.open()  # the CLI made a derive-only KEK; start-up ran every step on the token
    try:
        assert kek.dek_custody is not None
        assert kek.dek_custody.runner_alg == jwe_cek.RSA_OAEP  # SoftHSM2 2.6.1: no OAEP-256
    finally:
        await kek.close()
    for uri, problem in (
        (gcm + "&x-hsm-rewrap=true", "cannot derive"),
        (custody.replace("&x-hsm-rewrap=true", ""), "cannot encrypt"),
    ):
        kek = Pkcs11Kek(await asyncio.to_thread(parse_pkcs11_uri, uri))
        with pytest.raises(ConfigError) as caught:
            await kek.open()
        assert problem in caught.value.message
    with pytest.raises(ConfigError):
        await asyncio.to_thread(
            parse_pkcs11_uri, custody.replace("x-hsm-rewrap=true", "x-hsm-rewrap=yes")
        )


def test_what_softhsm2_cannot_do_inside_the_token(softhsm: str) -> None:
    """The measurements docs/keys.md quotes. If this fails, the token learned something:
    update "What the token cannot do" (and maybe the design)."""

    def measure(session: Any) -> dict[str, str]:
        key = session.generate_key(KeyType.AES, 256, template={pkcs11.Attribute.TOKEN: False})
        dek = session.generate_key(KeyType.AES, 256, template={pkcs11.Attribute.EXTRACTABLE: True})
        found: dict[str, str] = {}

        def attempt(name: str, call: Callable[[], object]) -> None:
            try:
                call()
                found[name] = "ok"
            except pkcs11.PKCS11Error as exc:
                found[name] = type(exc).__name__

        gcm = pkcs11.GCMParams(b"\0" * 12, b"aad", 128)
        attempt(
            "wrap AES_GCM",
            lambda: key.wrap_key(dek, mechanism=Mechanism.AES_GCM, mechanism_param=gcm),
        )
        attempt(
            "wrap AES_KEY_WRAP_PAD", lambda: key.wrap_key(dek, mechanism=Mechanism.AES_KEY_WRAP_PAD)
        )
        numbers = (
            rsa.generate_private_key(public_exponent=65537, key_size=2048)
            .public_key()
            .public_numbers()
        )
        public = session.create_object(
            {
                pkcs11.Attribute.CLASS: ObjectClass.PUBLIC_KEY,
                pkcs11.Attribute.KEY_TYPE: KeyType.RSA,
                pkcs11.Attribute.TOKEN: False,
                pkcs11.Attribute.MODULUS: numbers.n.to_bytes(256, "big"),
                pkcs11.Attribute.PUBLIC_EXPONENT: numbers.e.to_bytes(3, "big"),
                pkcs11.Attribute.WRAP: True,
            }
        )
        sha256 = (Mechanism.SHA256, pkcs11.MGF.SHA256, None)
        sha1 = (Mechanism.SHA_1, pkcs11.MGF.SHA1, None)
        for name, params in (("OAEP SHA-256", sha256), ("OAEP SHA-1", sha1)):
            attempt(
                "wrap RSA " + name, partial(public.wrap_key, dek, Mechanism.RSA_PKCS_OAEP, params)
            )
        _, ephemeral = session.generate_keypair(
            KeyType.EC,
            public_template={
                pkcs11.Attribute.EC_PARAMS: encode_named_curve_parameters("secp256r1")
            },
            private_template={pkcs11.Attribute.DERIVE: True},
        )
        runner = ec.generate_private_key(ec.SECP256R1()).public_key()
        point = runner.public_bytes(Encoding.X962, PublicFormat.UncompressedPoint)
        attempt(  # a KDF inside the derive (JOSE's Concat KDF is not offered at all)
            "ECDH1_DERIVE with a SHA-256 KDF",
            lambda: ephemeral.derive_key(
                KeyType.AES, 256, mechanism_param=(pkcs11.KDF.SHA256, b"other-info", point)
            ),
        )
        slot_mechanisms = {m.value for m in session.token.slot.get_mechanisms()}
        found["HKDF"] = "offered" if CKM_HKDF_DERIVE in slot_mechanisms else "absent"
        for obj in (ephemeral, public, dek, key):
            obj.destroy()
        return found

    found = on_token(softhsm, measure)
    assert found == {
        "wrap AES_GCM": "MechanismInvalid",  # CKR_MECHANISM_INVALID
        "wrap AES_KEY_WRAP_PAD": "ok",
        "wrap RSA OAEP SHA-256": "ArgumentsBad",  # CKR_ARGUMENTS_BAD
        "wrap RSA OAEP SHA-1": "ok",
        "ECDH1_DERIVE with a SHA-256 KDF": "MechanismParamInvalid",  # CKR_MECHANISM_PARAM_INVALID
        "HKDF": "absent",
    }

"""The KBS protocol facade end to end (issue 33): a guest as guest-components' client behaves
(``tests/support/kbs_client.py``) runs auth → attest (sample evidence, development switch on) →
resource against a live broker, and the answer decrypts, as the guest decrypts it, to the very
DEK the key service holds; the Bearer path (the confidential data hub's) does the same. Each
request is one record of the kind the readers know, naming the protocol, the guest's ``tee``, the
session by its hash (never the cookie), the path and the key."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Callable
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any

import aiohttp
import jwt
import pytest
from yarl import URL

from broker.core.encoding import b64url_decode
from broker.keys.factory import open_key_service
from tests.integration.conftest import RunningBroker
from tests.integration.kbs import PINNED, RESOURCE, guest, kbs_broker
from tests.support import kbs_guest, kbs_harness
from tests.support.constants import KEY
from tests.support.kbs_client import open_as_guest

EAR_TEE_PUBKEY = ("submods", "cpu0", "ear.veraison.annotated-evidence", "runtime_data_claims")


async def dek_of(broker: RunningBroker, version: int | None = None) -> tuple[bytes, int]:
    async with open_key_service(broker.settings.keys) as keys:
        record = await keys.resolve(KEY, version)
        return await keys.unwrap(record), record.version


def assert_cookie_reaches_a_prefixed_kbs(set_cookie: str) -> None:
    """The cookie's attributes, exactly: no ``Path`` (as Trustee), so that a guest whose KBS URL
    has a path prefix (a reverse proxy's ``/tenant/kbs/v0/…``) sends it back to ``/attest``."""
    (morsel,) = SimpleCookie(set_cookie).values()
    attributes = {name for name, value in morsel.items() if value}
    assert attributes == {"httponly", "secure", "max-age", "samesite"}, set_cookie
    assert (morsel["max-age"], morsel["samesite"]) == ("300", "Strict")
    jar = aiohttp.CookieJar(unsafe=True)
    jar.update_cookies(SimpleCookie(set_cookie), URL("https://127.0.0.1/tenant/kbs/v0/auth"))
    sent = jar.filter_cookies(URL("https://127.0.0.1/tenant/kbs/v0/attest"))
    assert morsel.key in sent


def _at(claims: dict[str, Any], path: tuple[str, ...]) -> Any:
    for part in path:
        claims = claims[part]
    return claims


@pytest.mark.parametrize("deployment", ["process", "workers"], indirect=True)
async def test_a_guest_fetches_its_key_through_the_facade(
    start_broker: Callable[..., Any],
) -> None:
    broker = (await kbs_broker(start_broker)).from_now_on()
    dek, version = await dek_of(broker)
    one = guest(broker)
    async with aiohttp.ClientSession() as session:
        status, challenge, headers = await one.call(
            session, "POST", "/auth", {"version": "0.4.0", "tee": "sample", "extra-params": {}}
        )
        assert status == 200, challenge
        assert challenge["extra-params"] == {"selected-hash-algorithm": "sha384"}
        one.nonce = challenge["nonce"]
        assert_cookie_reaches_a_prefixed_kbs(headers["Set-Cookie"])
        status, body = await one.attest(session)
        assert status == 200, body
        status, answer, _ = await one.resource(session, RESOURCE)
        assert status == 200, answer
        assert open_as_guest(answer, one.private) == dek
        assert set(answer) == {"protected", "encrypted_key", "iv", "ciphertext", "tag"}
    claims = jwt.decode(one.token or "", options={"verify_signature": False})
    assert _at(claims, EAR_TEE_PUBKEY)["tee-pubkey"] == one.tee_pubkey  # where Trustee reads it
    assert isinstance(claims["exp"], int)
    assert isinstance(claims["nbf"], int)
    assert "cnf" not in claims  # never a result usable under DPoP
    header = json.loads(b64url_decode(answer["protected"]))
    auth, attest, released = broker.records()
    assert [r["type"] for r in (auth, attest, released)] == [
        "kbs_auth",
        "kbs_attest",
        "kbs_resource",
    ]
    assert {r["result"] for r in (auth, attest, released)} == {"allow"}
    session_hash = auth["kbs"]["session"]
    assert one.cookie is not None
    assert one.cookie not in json.dumps(broker.records())
    assert auth["kbs"] | {"session_expires_at": None} == {
        "protocol": "0.4.0",
        "tee": "sample",
        "session": session_hash,
        "session_expires_at": None,
    }
    assert attest["kbs"]["session"] == released["kbs"]["session"] == session_hash
    assert attest["jti"] == claims["jti"] == released["attestation"]["jti"]
    assert released["attestation"]["log_index"] == attest["index"]
    assert (released["key"], released["version"], released["kid"]) == (KEY, version, header["kid"])
    assert released["kbs"] == {
        "protocol": "0.4.0",
        "tee": "sample",
        "session": session_hash,
        "credential": "cookie",
        "path": RESOURCE,
    }
    assert header["release_id"] == released["decision_id"]
    assert header["key_version"] == version
    assert header["policy_digest"] == released["policy_digest"]
    assert released["input"]["request"]["key"] == KEY
    assert released["input"]["claims"]["kbs"]["tee"] == "sample"


async def test_the_data_hubs_bearer_token_fetches_a_pinned_version(
    start_broker: Callable[..., Any],
) -> None:
    """The confidential data hub presents the token, no cookie (a fresh HTTP session)."""
    broker = await kbs_broker(start_broker)
    dek, _ = await dek_of(broker, 1)
    one = guest(broker, "RSA")
    async with aiohttp.ClientSession() as session:
        await one.handshake(session)
    async with aiohttp.ClientSession() as session:
        status, answer, _ = await one.resource(session, PINNED, cookie="", bearer=one.token)
    assert status == 200, answer
    assert open_as_guest(answer, one.private) == dek
    released = broker.records()[-1]
    assert (released["kbs"]["credential"], released["kbs"]["session"]) == ("bearer", None)
    assert (released["key"], released["version"]) == (KEY, 1)


@pytest.mark.timeout(kbs_harness.BUILD_TIMEOUT_S)
@pytest.mark.parametrize("kind", ["P-256", "P-521", "RSA"])
async def test_the_guests_own_crates_decrypt_a_live_answer(
    start_broker: Callable[..., Any], tmp_path: Path, kind: str
) -> None:
    """``tests/kbs_conformance`` (kbs-types 0.18 and RustCrypto, both serde_json map orders)
    reads the facade's answer to a live guest as guest-components does."""
    binaries = await asyncio.to_thread(kbs_harness.build)
    broker = await kbs_broker(start_broker)
    dek, _ = await dek_of(broker)
    one = guest(broker, kind)
    async with aiohttp.ClientSession() as session:
        await one.handshake(session)
        status, answer, _ = await one.resource(session, RESOURCE)
    assert status == 200, answer
    (tmp_path / "key.json").write_text(json.dumps(kbs_guest.private_jwk(one.private)))
    (tmp_path / "answer.json").write_text(json.dumps(answer))
    for regime, binary in binaries.items():
        done = await asyncio.to_thread(
            subprocess.run,
            [str(binary), "decrypt", str(tmp_path / "key.json"), str(tmp_path / "answer.json")],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert (done.returncode, done.stdout.strip()) == (0, dek.hex()), (regime, done.stderr)

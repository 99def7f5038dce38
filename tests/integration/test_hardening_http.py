"""Regression tests for the HTTP-layer defects of the hardening issue (items 1-8), each named
after what it stops. Every one of these answered 500, hung, or answered plain text before."""

from __future__ import annotations

import asyncio
import json
import zlib
from typing import Any

import aiohttp
import pytest

from broker.client.unwrap import new_ephemeral_key
from broker.crypto.jwk import public_jwk
from tests.integration.conftest import RunningBroker
from tests.integration.rawhttp import open_raw, raw_exchange, read_reply, request_bytes
from tests.integration.test_attacks_http import fresh_request, post
from tests.support.constants import KEY


def release_records(broker: RunningBroker) -> list[dict[str, Any]]:
    return [r for r in broker.records() if r.get("type") == "release"]


# --- 1. bodies are read whole ----------------------------------------------------------------


async def test_padded_release_body_past_64kib_is_read_whole(broker: RunningBroker) -> None:
    request = await fresh_request(broker)
    text = json.dumps(request)
    padded = text[:-1] + " " * (200 * 1024) + "}"  # whitespace is valid JSON padding
    for _ in range(3):  # it used to fail at random, depending on TCP segmentation
        reply = await raw_exchange(
            broker.url, broker.client_tls, request_bytes("POST", "/v1/release", padded.encode())
        )
        if reply.status != 401:  # the second and third attempts reuse the nonce
            assert reply.status == 200, reply.body
    assert release_records(broker)[0]["result"] == "allow"


async def test_body_of_exactly_max_body_bytes_accepted(broker: RunningBroker) -> None:
    limit = broker.settings.server.max_body_bytes
    request = await fresh_request(broker)
    text = json.dumps(request)
    exact = text[:-1] + " " * (limit - len(text)) + "}"
    assert len(exact.encode()) == limit
    status, body = await post(broker, "/v1/release", exact)
    assert status == 200, body


async def test_body_one_byte_over_the_limit_is_413(broker: RunningBroker) -> None:
    limit = broker.settings.server.max_body_bytes
    status, body = await post(broker, "/v1/release", "{" + " " * (limit - 1) + "}")
    assert (status, body["error"]["code"]) == (413, "body_too_large")


async def test_chunked_body_over_the_limit_is_413_not_malformed_json(
    broker: RunningBroker,
) -> None:
    limit = broker.settings.server.max_body_bytes

    async def chunks() -> Any:
        yield b"{"
        for _ in range(limit // 8192 + 2):
            yield b" " * 8192
        yield b"}"

    async with (
        aiohttp.ClientSession() as session,
        session.post(
            broker.url + "/v1/release",
            data=chunks(),
            headers={"Content-Type": "application/json"},
            ssl=broker.client_tls,
        ) as response,
    ):
        body = await response.json()
    assert (response.status, body["error"]["code"]) == (413, "body_too_large")


async def test_body_shorter_than_content_length_is_not_processed(start_broker: Any) -> None:
    broker = await start_broker(body_timeout_seconds=1.0)
    request = await fresh_request(broker)
    data = json.dumps(request).encode()  # a complete, valid release ...
    reply = await raw_exchange(  # ... that declares 100 more bytes than it sends
        broker.url,
        broker.client_tls,
        request_bytes("POST", "/v1/release", data, content_length=len(data) + 100),
    )
    assert (reply.status, reply.json()["error"]["code"]) == (408, "request_timeout")
    assert not release_records(broker)  # it was never processed


async def test_slow_body_gets_408(start_broker: Any) -> None:
    broker = await start_broker(body_timeout_seconds=0.5)
    reader, writer = await open_raw(broker.url, broker.client_tls)
    writer.write(request_bytes("POST", "/v1/release", b'{"key":', content_length=500))
    await writer.drain()
    reply = await read_reply(reader, timeout=5)
    writer.close()
    assert (reply.status, reply.json()["error"]["code"]) == (408, "request_timeout")


# --- 2. every outcome after the body parsed is exactly one record -----------------------------


@pytest.mark.parametrize(
    ("evidence", "code"),
    [([], "bad_request"), ("a string", "bad_request"), ({"gca": 7}, "bad_request")],
)
async def test_evidence_of_the_wrong_type_is_400_and_logged(
    broker: RunningBroker, evidence: Any, code: str
) -> None:
    request = await fresh_request(broker)
    status, body = await post(broker, "/v1/release", dict(request, evidence=evidence))
    assert (status, body["error"]["code"]) == (400, code)
    records = release_records(broker)
    assert len(records) == 1
    assert (records[0]["result"], records[0]["code"]) == ("deny", code)
    assert records[0]["request_id"] == body["error"]["request_id"]


async def test_malformed_release_fields_are_logged_as_denials(broker: RunningBroker) -> None:
    request = await fresh_request(broker)
    cases = [
        (dict(request, key=["models/llama"]), "bad_request"),
        (dict(request, version="1"), "bad_request"),
        (dict(request, runner_key="not a jwk"), "runner_key_invalid"),
        (dict(request, wrap=["jwe"]), "bad_request"),
        (dict(request, nonce=None), "bad_request"),
    ]
    for body, code in cases:
        status, reply = await post(broker, "/v1/release", body)
        assert (status, reply["error"]["code"]) == (400, code)
    records = release_records(broker)
    assert [(r["result"], r["code"]) for r in records] == [("deny", c) for _, c in cases]
    assert records[0]["key"] is None  # a hostile value is not copied into the log


# --- 3. small-order X25519 and off-curve EC runner keys --------------------------------------

SMALL_ORDER_X25519 = [
    "00" * 32,
    "01" + "00" * 31,
    "e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800",
    "5f9c95bca3508c24b1d0b1559c83ef5b04445cc4581c8e86d8224eddd09f1157",
    "ec" + "ff" * 30 + "7f",
    "ed" + "ff" * 30 + "7f",
    "ee" + "ff" * 30 + "7f",
    "e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b880",  # non-canonical
]


@pytest.mark.parametrize("point", SMALL_ORDER_X25519)
@pytest.mark.parametrize("wrap", ["jwe", "hpke"])
async def test_small_order_x25519_runner_key_rejected(
    broker: RunningBroker, point: str, wrap: str
) -> None:
    from broker.core.encoding import b64url_encode  # noqa: PLC0415

    request = await fresh_request(broker)
    jwk = {"kty": "OKP", "crv": "X25519", "x": b64url_encode(bytes.fromhex(point))}
    status, body = await post(broker, "/v1/release", dict(request, runner_key=jwk, wrap=wrap))
    assert (status, body["error"]["code"]) == (400, "runner_key_invalid")
    assert release_records(broker)[-1]["code"] == "runner_key_invalid"


async def test_ec_runner_key_not_on_the_curve_rejected(broker: RunningBroker) -> None:
    request = await fresh_request(broker)
    jwk = public_jwk(new_ephemeral_key().public_key())
    off_curve = {"kty": "EC", "crv": "P-256", "x": jwk["x"], "y": jwk["x"]}  # y := x
    status, body = await post(broker, "/v1/release", dict(request, runner_key=off_curve))
    assert (status, body["error"]["code"]) == (400, "runner_key_invalid")
    assert "not on the curve" in body["error"]["message"]


# --- 4. nesting depth -----------------------------------------------------------------------


@pytest.mark.parametrize("depth", [65, 1000, 100_000])
async def test_deeply_nested_json_body_is_400(broker: RunningBroker, depth: int) -> None:
    status, body = await post(broker, "/v1/release", "[" * depth + "]" * depth)
    assert (status, body["error"]["code"]) == (400, "malformed_json")


async def test_deeply_nested_evidence_is_400(broker: RunningBroker) -> None:
    request = await fresh_request(broker)
    nested: Any = {}
    for _ in range(70):
        nested = {"a": nested}
    status, body = await post(broker, "/v1/release", dict(request, evidence=nested))
    assert (status, body["error"]["code"]) == (400, "malformed_json")


# --- 5, 6, 7: headers, encodings and aiohttp's own errors -------------------------------------


async def test_non_ascii_authorization_header_is_401(broker: RunningBroker) -> None:
    data = request_bytes("GET", "/v1/admin/keys", headers={"Authorization": "Bearer caf\xe9\xff"})
    reply = await raw_exchange(broker.url, broker.client_tls, data)
    assert (reply.status, reply.json()["error"]["code"]) == (401, "unauthorized")


@pytest.mark.parametrize("encoding", ["deflate", "gzip", "x-unknown"])
async def test_compressed_or_garbage_encoded_body_is_415(
    broker: RunningBroker, encoding: str
) -> None:
    garbage = b"\x00\x01not deflate at all" if encoding != "deflate" else b"\xffgarbage"
    for body in (garbage, zlib.compress(b"{}")):
        reply = await raw_exchange(
            broker.url,
            broker.client_tls,
            request_bytes("POST", "/v1/release", body, headers={"Content-Encoding": encoding}),
        )
        assert (reply.status, reply.json()["error"]["code"]) == (415, "unsupported_media_type")


@pytest.mark.parametrize(
    "raw",
    [
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nBad Header: <script>echo-me</script>\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nX: a\x00b\r\n\r\n",
        b"BREW /healthz HTTP/9.9\r\n\r\n",
        b"GET /healthz<script> HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n",
        b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nX: " + b"a" * 20000 + b"\r\n\r\n",
    ],
)
async def test_protocol_errors_are_json_and_echo_nothing(broker: RunningBroker, raw: bytes) -> None:
    reply = await raw_exchange(broker.url, broker.client_tls, raw)
    assert 400 <= reply.status < 500
    assert reply.headers["content-type"].startswith("application/json")
    error = reply.json()["error"]
    assert error["code"] == ("not_found" if b"<script>" in raw[:20] else "bad_request")
    assert error["request_id"]
    # The request id is random hex, so it may itself contain "aaaa": look at everything else.
    rest = reply.body.replace(error["request_id"].encode(), b"")
    assert b"echo-me" not in rest
    assert b"script" not in rest
    assert b"aaaa" not in rest


# --- 8. slow sockets -----------------------------------------------------------------------


async def test_slow_header_socket_is_closed(start_broker: Any) -> None:
    broker = await start_broker(header_timeout_seconds=0.5)
    reader, writer = await open_raw(broker.url, broker.client_tls)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # never finishes the head
    await writer.drain()
    async with asyncio.timeout(5):
        assert await reader.read() == b""  # closed by the server
    writer.close()


async def test_silent_socket_is_closed(start_broker: Any) -> None:
    broker = await start_broker(header_timeout_seconds=0.5)
    reader, writer = await open_raw(broker.url, broker.client_tls)
    async with asyncio.timeout(5):
        assert await reader.read() == b""
    writer.close()


async def test_idle_keepalive_connection_is_closed(start_broker: Any) -> None:
    broker = await start_broker(keepalive_timeout_seconds=0.5, header_timeout_seconds=30)
    reader, writer = await open_raw(broker.url, broker.client_tls)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await read_reply(reader)).status == 200
    async with asyncio.timeout(5):
        assert await reader.read() == b""
    writer.close()


async def test_connections_over_the_per_ip_cap_are_closed(start_broker: Any) -> None:
    broker = await start_broker(max_connections_per_ip=4, header_timeout_seconds=30)
    held = [await open_raw(broker.url, broker.client_tls) for _ in range(4)]
    reader, writer = await open_raw(broker.url, broker.client_tls)
    async with asyncio.timeout(5):
        assert await reader.read() == b""  # the fifth is closed at once
    writer.close()
    for _, w in held:
        w.close()
    # Freed slots are reused once the broker has seen the closes (polled: a loaded CI machine
    # may take longer than a fixed sleep).
    for _ in range(150):
        await asyncio.sleep(0.1)
        reader, writer = await open_raw(broker.url, broker.client_tls)
        try:
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            reply = await read_reply(reader)
        except (asyncio.IncompleteReadError, ConnectionError):
            continue  # still over the cap: closed at once
        finally:
            writer.close()
        assert reply.status == 200
        break
    else:
        raise AssertionError("freed connection slots were never reused")


async def test_key_name_in_release_is_not_echoed(broker: RunningBroker) -> None:
    request = await fresh_request(broker)
    status, body = await post(broker, "/v1/release", dict(request, key="<script>" + KEY))
    assert status == 400
    assert "<script>" not in json.dumps(body)


@pytest.mark.parametrize(
    "chunks",
    [
        b"zz\r\n{}\r\n0\r\n\r\n",  # chunk size not hex
        b"5\r\n{}\r\n0\r\n\r\n",  # chunk shorter than its size
        b"2\r\n{}XX0\r\n\r\n",  # no CRLF after the chunk
        b"-1\r\n{}\r\n0\r\n\r\n",  # negative size
    ],
)
async def test_malformed_chunked_body_is_400_not_500(broker: RunningBroker, chunks: bytes) -> None:
    data = request_bytes("POST", "/v1/release", chunks, headers={"Transfer-Encoding": "chunked"})
    reply = await raw_exchange(broker.url, broker.client_tls, data)
    assert reply.status == 400, reply.body
    assert reply.json()["error"]["code"] == "bad_request"

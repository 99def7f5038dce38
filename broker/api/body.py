"""Reading JSON bodies at the boundary: size, media type, syntax, and exact field sets.

Our own API bodies forbid unknown fields, so a typo in a field name is an error, not a silently
ignored option.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from broker.api.services import SETTINGS
from broker.core.errors import (
    BodyTooLarge,
    ErrorCode,
    InputError,
    RequestTimeout,
    UnsupportedMediaType,
)
from broker.core.fields import optional_version, string_field
from broker.core.jsonsafe import loads_bounded

__all__ = ["optional_version", "read_body", "read_json_object", "string_field"]

# Runners have no reason to compress a few KiB of JSON, and a decompressor is an attack surface
# (bombs, malformed streams): bodies are accepted in identity encoding only.
ACCEPTED_ENCODINGS = frozenset({"", "identity"})
READ_CHUNK = 64 * 1024


async def read_body(request: web.Request, *, max_bytes: int, timeout_seconds: float) -> bytes:
    """The whole request body, at most ``max_bytes``, within ``timeout_seconds``.

    ``request.content.read(n)`` returns what is buffered so far, not ``n`` bytes; this reads
    until the end of the body (Content-Length or the last chunk).

    Raises:
        UnsupportedMediaType: a ``Content-Encoding`` other than identity.
        BodyTooLarge: over ``max_bytes`` (declared or actually sent, chunked included).
        RequestTimeout: the body did not arrive in time (408).
        InputError: the body ended before its declared length, or was malformed on the wire.
    """
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    if encoding not in ACCEPTED_ENCODINGS:
        raise UnsupportedMediaType("Content-Encoding must be identity (compression is refused)")
    if request.content_length is not None and request.content_length > max_bytes:
        raise BodyTooLarge(f"request body exceeds {max_bytes} bytes")
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_seconds):
            while True:
                chunk = await request.content.read(READ_CHUNK)
                if not chunk:
                    break
                size += len(chunk)
                if size > max_bytes:
                    raise BodyTooLarge(f"request body exceeds {max_bytes} bytes")
                chunks.append(chunk)
    except TimeoutError as exc:
        raise RequestTimeout(f"request body not received within {timeout_seconds} s") from exc
    except (HttpProcessingError, web.RequestPayloadError, ConnectionError) as exc:
        # RequestPayloadError is a bare Exception (not an HttpProcessingError): aiohttp raises
        # it for a body that breaks off or fails to decode while we read it.
        raise InputError("request body ended early or is malformed") from exc
    if request.content_length is not None and size != request.content_length:
        raise InputError("request body is shorter than its Content-Length")
    return b"".join(chunks)


async def read_json_object(
    request: web.Request,
    *,
    required: Collection[str],
    optional: Collection[str] = (),
) -> dict[str, Any]:
    """The request body as a JSON object with exactly the allowed fields.

    Limits come from ``[server] max_body_bytes`` and ``body_timeout_seconds``.

    Raises:
        UnsupportedMediaType: without ``Content-Type: application/json``, or compressed.
        BodyTooLarge: over ``max_bytes``.
        RequestTimeout: the body did not arrive within ``timeout_seconds``.
        InputError: ``malformed_json`` (syntax, encoding, nesting), or ``bad_request`` naming
            the field.
    """
    if request.content_type != "application/json":
        raise UnsupportedMediaType("Content-Type must be application/json")
    server = request.app[SETTINGS].server
    raw = await read_body(
        request, max_bytes=server.max_body_bytes, timeout_seconds=server.body_timeout_seconds
    )
    try:
        body = loads_bounded(raw)
    except ValueError as exc:
        raise InputError(
            f"request body is not valid JSON ({exc})"
            if "nested" in str(exc)
            else "request body is not valid JSON",
            code=ErrorCode.MALFORMED_JSON,
        ) from exc
    if not isinstance(body, dict):
        raise InputError("request body must be a JSON object")
    unknown = sorted(set(body) - set(required) - set(optional))
    if unknown:
        raise InputError(f"unknown fields: {', '.join(_safe_names(unknown))}")
    missing = sorted(set(required) - set(body))
    if missing:
        raise InputError(f"missing fields: {', '.join(missing)}")
    return body


def _safe_names(names: list[str]) -> list[str]:
    """Field names as shown back: a few, short, printable (never a reflected payload)."""
    shown = [n if n.isprintable() and len(n) <= 40 else "<unprintable or long>" for n in names]
    return shown[:5] + ([f"… {len(names) - 5} more"] if len(names) > 5 else [])

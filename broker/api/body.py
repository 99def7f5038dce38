"""Reading JSON bodies at the boundary: size, media type, syntax, and exact field sets.

Our own API bodies forbid unknown fields, so a typo in a field name is an error, not a silently
ignored option.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

from aiohttp import web

from broker.errors import BodyTooLarge, ErrorCode, InputError, UnsupportedMediaType


async def read_json_object(
    request: web.Request,
    *,
    max_bytes: int,
    required: Collection[str],
    optional: Collection[str] = (),
) -> dict[str, Any]:
    """The request body as a JSON object with exactly the allowed fields.

    Raises:
        UnsupportedMediaType: without ``Content-Type: application/json``.
        BodyTooLarge: over ``max_bytes``.
        InputError: ``malformed_json``, or ``bad_request`` naming the field.
    """
    if request.content_type != "application/json":
        raise UnsupportedMediaType("Content-Type must be application/json")
    if request.content_length is not None and request.content_length > max_bytes:
        raise BodyTooLarge(f"request body exceeds {max_bytes} bytes")
    try:
        raw = await request.content.read(max_bytes + 1)
    except web.HTTPRequestEntityTooLarge as exc:
        raise BodyTooLarge(f"request body exceeds {max_bytes} bytes") from exc
    if len(raw) > max_bytes:
        raise BodyTooLarge(f"request body exceeds {max_bytes} bytes")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InputError("request body is not valid JSON", code=ErrorCode.MALFORMED_JSON) from exc
    if not isinstance(body, dict):
        raise InputError("request body must be a JSON object")
    unknown = sorted(set(body) - set(required) - set(optional))
    if unknown:
        raise InputError(f"unknown fields: {', '.join(unknown)}")
    missing = sorted(set(required) - set(body))
    if missing:
        raise InputError(f"missing fields: {', '.join(missing)}")
    return body


def string_field(body: dict[str, Any], name: str, *, max_chars: int) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value or len(value) > max_chars:
        raise InputError(f"{name} must be a non-empty string of at most {max_chars} characters")
    return value


def optional_version(body: dict[str, Any]) -> int | None:
    value = body.get("version")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 2**31:
        raise InputError("version must be a positive integer")
    return value

"""``GET /readyz`` as an operator reads it: its details need an admin token (any role).

A broker started with ``HEALTH_ENV`` (or any admin token) shows its checks to ``readyz``;
anonymous callers get ``{"status": …}`` only.
"""

from __future__ import annotations

import hashlib
import json
import ssl
import urllib.error
import urllib.request
from typing import Any

import aiohttp

HEALTH_TOKEN = "readyz-details-token-5f1d0c"
HEALTH_ENV = {"BROKER_ADMIN_TOKEN_SHA256": hashlib.sha256(HEALTH_TOKEN.encode()).hexdigest()}


def bearer(token: str = HEALTH_TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def readyz(
    session: aiohttp.ClientSession, url: str, tls: ssl.SSLContext, token: str = HEALTH_TOKEN
) -> tuple[int, dict[str, Any]]:
    """(status, body) of ``/readyz`` with the details an admin sees."""
    async with session.get(url + "/readyz", ssl=tls, headers=bearer(token)) as response:
        return response.status, await response.json()


def readyz_blocking(
    url: str, tls: ssl.SSLContext, token: str = HEALTH_TOKEN
) -> tuple[int, dict[str, Any]]:
    """``readyz`` for synchronous tests (a broker in another process)."""
    request = urllib.request.Request(url + "/readyz", headers=bearer(token))
    try:
        with urllib.request.urlopen(request, context=tls, timeout=5) as response:
            return int(response.status), json.loads(response.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return int(exc.code), json.loads(exc.read())

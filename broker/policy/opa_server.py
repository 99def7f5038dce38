"""The OPA server engine: ``[policy] engine = "opa"``, an OPA running as a sidecar.

The same input goes to ``POST <opa_url>/v1/data/broker/release`` through opa-python-client's
async client, bounded by ``eval_timeout_ms``; no answer, an error, or a timeout is
``503 policy_unavailable`` — never an allow. OPA's own error (e.g. a conflict between complete
rules, with the rule and location) is logged verbatim. The sidecar loads its policy itself (a
bundle or files); ``policy_digest`` in records is the configured policy directory's digest when
one is set, else the bundle revision OPA reports.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from opa_client.opa_async import AsyncOpaClient

from broker.core.errors import ErrorCode, UpstreamError
from broker.core.protocol import ATTEST_KIND, IDENTITY_KIND
from broker.policy.engine import Decision

log = logging.getLogger(__name__)
RELEASE_PATH = "broker/release"
ATTEST_PATH = "broker/attest"
IDENTITY_PATH = "broker/identity"


def policy_path(policy_input: Mapping[str, Any]) -> str:
    """The package the input is for, as the Wasm engine's wrapper chooses it (``build.py``)."""
    request = policy_input.get("request")
    kind = request.get("kind") if isinstance(request, Mapping) else None
    paths = {ATTEST_KIND: ATTEST_PATH, IDENTITY_KIND: IDENTITY_PATH}
    return paths.get(kind, RELEASE_PATH) if isinstance(kind, str) else RELEASE_PATH


class _Client(AsyncOpaClient):  # type: ignore[misc]
    async def decide(self, policy_input: Mapping[str, Any]) -> Any:
        """``POST /v1/data/broker/release`` (or ``…/attest``); OPA's error body is kept."""
        url = f"{self.root_url}/data/{policy_path(policy_input)}"
        async with self._request("POST", url, json={"input": dict(policy_input)}) as response:
            body = await response.json(content_type=None)
            if response.status != 200:
                raise _OpaFailed(response.status, body)
            return body


class _OpaFailed(Exception):
    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"OPA answered {status}: {body}")


class OpaServerEngine:
    """``PolicyEngine`` that asks an OPA server."""

    def __init__(self, url: str, *, timeout_seconds: float, digest: str) -> None:
        parts = urlsplit(url)
        self._client = _Client(
            host=parts.hostname or "127.0.0.1",
            port=parts.port or (443 if parts.scheme == "https" else 8181),
            ssl=parts.scheme == "https",
            timeout=timeout_seconds,
            retries=0,
        )
        self._timeout = timeout_seconds
        self._digest = digest

    @property
    def digest(self) -> str:
        return self._digest

    async def open(self) -> None:
        await self._client._init_session()

    async def close(self) -> None:
        await self._client.close_connection()

    async def evaluate(
        self, policy_input: Mapping[str, Any], *, encoded: bytes | None = None
    ) -> Decision:
        del encoded  # the HTTP client writes the request body itself
        try:
            async with asyncio.timeout(self._timeout):
                body = await self._client.decide(policy_input)
        except (TimeoutError, aiohttp.ClientError, _OpaFailed, ValueError) as exc:
            log.error("OPA server engine: %s", exc)  # noqa: TRY400 - the message is OPA's
            raise UpstreamError(
                "the policy engine did not answer", code=ErrorCode.POLICY_UNAVAILABLE
            ) from exc
        result = body.get("result") if isinstance(body, dict) else None
        return Decision.from_result(result, self._digest)

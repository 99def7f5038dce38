"""What every hostile case is made of: the fresh request material, the context, the case."""

from __future__ import annotations

import base64
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from broker.client.unwrap import new_ephemeral_key
from broker.core.binding import binding_digest
from broker.core.encoding import b64url_decode
from broker.crypto.jwk import public_jwk, thumbprint
from broker.dev.issuer import DevIssuer, Workload
from tests.support.constants import ALLOWED, KEY
from tests.vectors.gpu import SimulatedGpu, SimulatedNras

ADMIN_TOKEN = "hostile-suite-admin-token-7c1e"
DELETE = object()  # a claim override that removes the claim
NO_BODY = object()  # a request without a body (``None`` is the JSON body ``null``)


@dataclass
class Fresh:
    """A fresh, well-formed release: nonce, runner key, thumbprint, bound token."""

    nonce: str
    jwk: dict[str, str]
    thumb: str
    claims: dict[str, Any]
    token: str

    def body(self, **fields: Any) -> dict[str, Any]:
        body: dict[str, Any] = {
            "key": KEY,
            "nonce": self.nonce,
            "evidence": {"gca": self.token},
            "runner_key": self.jwk,
        }
        for name, value in fields.items():
            if value is DELETE:
                body.pop(name, None)
            else:
                body[name] = value
        return body

    @property
    def gpu_nonce(self) -> bytes:
        return binding_digest(self.nonce, self.thumb)


@dataclass
class Ctx:
    """What case bodies are built from (set up by the test)."""

    issuer: DevIssuer
    audience: str
    gpu: SimulatedGpu
    nras: SimulatedNras
    stranger_gpu: SimulatedGpu
    challenge: Callable[[], Awaitable[str]]

    async def fresh(self, *, digest: str = ALLOWED, gpu_cc_mode: str | None = None) -> Fresh:
        nonce = await self.challenge()
        jwk = public_jwk(new_ephemeral_key().public_key())
        thumb = thumbprint(jwk)
        token = self.issuer.mint(
            audience=self.audience,
            nonces=[nonce, thumb],
            workload=Workload(image_digest=digest, gpu_cc_mode=gpu_cc_mode),
            now=utc_now(),
        )
        claims = json.loads(b64url_decode(token.split(".")[1]))
        return Fresh(nonce, jwk, thumb, claims, token)

    def resign(
        self, claims: dict[str, Any], overrides: dict[str, Any], header: dict[str, Any] | None
    ) -> str:
        changed = {k: v for k, v in {**claims, **overrides}.items() if v is not DELETE}
        return self.issuer.sign(changed, header)


def utc_now() -> datetime:
    return datetime.now(UTC)


def b64std(data: bytes) -> str:
    """Standard (not URL-safe) base64, as NVIDIA evidence and Basic credentials use."""
    return base64.b64encode(data).decode()


Body = Callable[[Ctx], Awaitable[Any]]


@dataclass
class Case:
    name: str
    method: str
    path: str
    status: int
    code: str | None  # None: a success
    body: Any = NO_BODY  # JSON value, raw bytes, or an async builder taking Ctx
    headers: dict[str, str] = field(default_factory=dict)
    logged: bool = False  # a release whose body parsed: exactly one decision record
    admin: bool = False  # send the admin bearer token


def fresh_body(**fields: Any) -> Body:
    async def build(ctx: Ctx) -> Any:
        return (await ctx.fresh()).body(**fields)

    return build


def release(name: str, body: Any, status: int, code: str | None, *, logged: bool = True) -> Case:
    return Case(name, "POST", "/v1/release", status, code, body, logged=logged)

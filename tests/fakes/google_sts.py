"""A loopback Security Token Service for Workload Identity Federation, as sts.googleapis.com
answers ``POST /v1/token`` (RFC 8693 token exchange) for one OIDC workload identity pool provider.

It does what the real STS does with a Confidential Space attestation token, in the order Google
documents (cloud.google.com/iam/docs/reference/sts/rest/v1/TopLevel/token,
cloud.google.com/iam/docs/workload-identity-federation):

1. the request is a token exchange for an access token (``grant_type``,
   ``requested_token_type``), its ``audience`` is the provider's full resource name
   (``//iam.googleapis.com/projects/N/locations/global/workloadIdentityPools/P/providers/V``) and
   its ``subject_token_type`` a JWT;
2. the subject token's RS256 signature verifies with the provider issuer's JWKS (here the
   development issuer's, ``broker/dev/issuer.py``, instead of Confidential Space's), its ``iss``
   is the provider's issuer URI, its ``aud`` one of the allowed audiences
   (``https://sts.googleapis.com``) and it has not expired;
3. the provider's attribute condition, read from ``deploy/confidential-space/broker/
   wif-condition.cel`` (the file ``wif.sh`` gives gcloud), is evaluated by a real CEL
   implementation (cel-python) over ``assertion`` = the token's claims; false or an evaluation
   error (a missing claim) refuses the token;
4. the attribute mapping (the same CEL expressions as ``wif.sh``'s ``--attribute-mapping``) makes
   the federated principal: ``google.subject`` (at most 127 bytes, as Google limits it) and
   ``attribute.image_digest``;
5. an opaque access token is issued for that principal; ``identities_of`` (what the loopback KMS
   asks, ``google_kms.KmsIam``) names its IAM identities: ``principal://…/subject/SUB`` and the
   ``principalSet://…/attribute.image_digest/DIGEST`` and ``principalSet://…/*`` sets.

Errors are Google's shape: HTTP 400 with ``{"error": "invalid_grant" | "invalid_target" | …,
"error_description": …}``.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import celpy
import jwt
from aiohttp import web
from celpy.adapter import json_to_cel
from celpy.celtypes import BoolType
from celpy.evaluation import CELEvalError

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "confidential-space" / "broker"
CONDITION_FILE = DEPLOY / "wif-condition.cel"
DIGEST_PLACEHOLDER = "@IMAGE_DIGEST@"
STS_AUDIENCE = "https://sts.googleapis.com"
TOKEN_EXCHANGE = "urn:ietf:params:oauth:grant-type:token-exchange"
ACCESS_TOKEN_TYPE = "urn:ietf:params:oauth:token-type:access_token"
JWT_TOKEN_TYPE = "urn:ietf:params:oauth:token-type:jwt"
# wif.sh's --attribute-mapping. The subject is Google's Confidential Space codelabs' (image digest,
# project number, instance id), not ``assertion.sub``: the VM's selfLink can pass the STS's
# 127-byte limit on google.subject (long project ids and instance names).
ATTRIBUTE_MAPPING = {
    "google.subject": '"gcpcs::"+assertion.submods.container.image_digest+"::"'
    '+assertion.submods.gce.project_number+"::"+assertion.submods.gce.instance_id',
    "attribute.image_digest": "assertion.submods.container.image_digest",
}
MAX_SUBJECT_BYTES = 127
# The pool and provider names wif.sh uses by default, in a test project.
PROJECT_NUMBER = "123456789012"
POOL, PROVIDER = "broker-pool", "broker-attestation"
TOKEN_SECONDS = 3600
REJECTED_BY_CONDITION = "The given credential is rejected by the attribute condition."


def provider_condition(image_digest: str) -> str:
    """The attribute condition ``wif.sh`` gives the provider for ``image_digest``."""
    template = CONDITION_FILE.read_text(encoding="utf-8")
    return template.replace(DIGEST_PLACEHOLDER, image_digest).replace("\n", " ").strip()


@dataclass(frozen=True)
class OidcProvider:
    project_number: str
    pool: str
    provider: str
    issuer: str  # the provider's --issuer-uri
    jwks: Mapping[str, Any]  # the issuer's keys
    condition: str  # CEL, as given to --attribute-condition
    allowed_audiences: tuple[str, ...] = (STS_AUDIENCE,)

    @property
    def pool_name(self) -> str:
        return f"projects/{self.project_number}/locations/global/workloadIdentityPools/{self.pool}"

    @property
    def audience(self) -> str:
        """What a credential configuration's ``audience`` (the STS request's) must be."""
        return f"//iam.googleapis.com/{self.pool_name}/providers/{self.provider}"

    def principal_set(self, attribute: str, value: str) -> str:
        return f"principalSet://iam.googleapis.com/{self.pool_name}/attribute.{attribute}/{value}"


def wif_sh_provider(issuer: str, jwks: Mapping[str, Any], image_digest: str) -> OidcProvider:
    """The provider ``wif.sh`` makes for ``image_digest``, trusting ``issuer``'s keys."""
    condition = provider_condition(image_digest)
    return OidcProvider(PROJECT_NUMBER, POOL, PROVIDER, issuer, jwks, condition)


@dataclass(frozen=True)
class Grant:
    subject: str
    attributes: Mapping[str, str]
    identities: frozenset[str]
    expires: float


class StsRefusal(Exception):
    def __init__(self, error: str, description: str) -> None:
        super().__init__(f"{error}: {description}")
        self.error = error
        self.description = description


@dataclass
class FakeSts:
    provider: OidcProvider
    grants: dict[str, Grant] = field(default_factory=dict)  # access token -> principal
    outcomes: list[str] = field(default_factory=list)  # "granted" or "ERROR: description"
    url: str = ""
    _runner: web.AppRunner | None = None
    _programs: dict[str, Any] = field(default_factory=dict)

    async def start(self) -> str:
        """Compile the condition and mapping (cel-python reads its grammar file: off the event
        loop), then listen on 127.0.0.1; the token endpoint's URL."""
        self._programs = await asyncio.to_thread(self._compile)
        app = web.Application()
        app.router.add_post("/v1/token", self._token)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}/v1/token"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def identities_of(self, access_token: str) -> frozenset[str] | None:
        grant = self.grants.get(access_token)
        if grant is None or grant.expires < time.time():
            return None
        return grant.identities

    def _compile(self) -> dict[str, Any]:
        env = celpy.Environment()
        sources = {"condition": self.provider.condition, **ATTRIBUTE_MAPPING}
        return {name: env.program(env.compile(text)) for name, text in sources.items()}

    async def _token(self, request: web.Request) -> web.Response:
        form = await request.post()
        try:
            grant = self._exchange({k: str(v) for k, v in form.items()})
        except StsRefusal as refusal:
            self.outcomes.append(f"{refusal.error}: {refusal.description}")
            body = {"error": refusal.error, "error_description": refusal.description}
            return web.json_response(body, status=400)
        token = "ya29.fake-federated-" + secrets.token_urlsafe(32)
        self.grants[token] = grant
        self.outcomes.append("granted")
        return web.json_response(
            {
                "access_token": token,
                "issued_token_type": ACCESS_TOKEN_TYPE,
                "token_type": "Bearer",
                "expires_in": TOKEN_SECONDS,
            }
        )

    def _exchange(self, form: Mapping[str, str]) -> Grant:
        # 1. the request
        if form.get("grant_type") != TOKEN_EXCHANGE:
            raise StsRefusal("unsupported_grant_type", "grant_type must be token-exchange")
        if form.get("requested_token_type") != ACCESS_TOKEN_TYPE:
            raise StsRefusal("invalid_request", "requested_token_type must be access_token")
        if form.get("audience") != self.provider.audience:
            raise StsRefusal(
                "invalid_target",
                'The target service indicated by the "audience" parameters is invalid.',
            )
        if form.get("subject_token_type") != JWT_TOKEN_TYPE:
            raise StsRefusal("invalid_request", "subject_token_type must be jwt")
        # 2. the subject token
        claims = self._verified_claims(form.get("subject_token", ""))
        # 3. the attribute condition
        assertion = {"assertion": json_to_cel(claims)}
        try:
            admitted = self._programs["condition"].evaluate(assertion)
        except CELEvalError:
            admitted = False
        if not (isinstance(admitted, BoolType) and bool(admitted)):
            raise StsRefusal("invalid_grant", REJECTED_BY_CONDITION)
        # 4. the attribute mapping
        mapped = {}
        for name in ATTRIBUTE_MAPPING:
            try:
                mapped[name] = str(self._programs[name].evaluate(assertion))
            except CELEvalError as exc:
                raise StsRefusal("invalid_grant", f"The mapping of {name} failed.") from exc
        if len(mapped["google.subject"].encode()) > MAX_SUBJECT_BYTES:
            raise StsRefusal(
                "invalid_grant",
                "The size of mapped attribute google.subject exceeds the 127 bytes limit.",
            )
        return self._grant(mapped, claims)

    def _verified_claims(self, token: str) -> dict[str, Any]:
        try:
            kid = jwt.get_unverified_header(token).get("kid")
            keys = [k for k in self.provider.jwks.get("keys", []) if k.get("kid") == kid]
            if not keys:
                raise StsRefusal("invalid_grant", "Invalid JWT: no matching key in the JWKS.")
            key = jwt.PyJWK.from_json(json.dumps(keys[0])).key
            claims: dict[str, Any] = jwt.decode(
                token,
                key,
                algorithms=["RS256"],
                audience=list(self.provider.allowed_audiences),
                issuer=self.provider.issuer.rstrip("/"),
                options={"require": ["iss", "aud", "exp", "iat", "sub"]},
            )
        except jwt.InvalidAudienceError as exc:
            raise StsRefusal(
                "invalid_grant", "The audience in ID Token does not match the expected audience."
            ) from exc
        except jwt.ExpiredSignatureError as exc:
            raise StsRefusal("invalid_grant", "ID Token has expired.") from exc
        except jwt.InvalidTokenError as exc:
            raise StsRefusal("invalid_grant", f"Invalid ID Token: {type(exc).__name__}.") from exc
        return claims

    def _grant(self, mapped: Mapping[str, str], claims: Mapping[str, Any]) -> Grant:
        base = f"iam.googleapis.com/{self.provider.pool_name}"
        attributes = {
            name.removeprefix("attribute."): value
            for name, value in mapped.items()
            if name.startswith("attribute.")
        }
        identities = {f"principal://{base}/subject/{mapped['google.subject']}"}
        identities |= {f"principalSet://{base}/*"}
        identities |= {f"principalSet://{base}/attribute.{k}/{v}" for k, v in attributes.items()}
        return Grant(
            subject=mapped["google.subject"],
            attributes=attributes,
            identities=frozenset(identities),
            expires=min(time.time() + TOKEN_SECONDS, float(claims["exp"])),
        )

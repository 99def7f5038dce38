"""Admin API: key lifecycle and policy reload over HTTP; every route declares the role it needs.

Authentication: ``Authorization: Bearer <token>``; the SHA-256 of the token is compared in
constant time against every configured digest (``[admin] token_sha256``: every role;
``[[admin.tokens]]``: the roles listed). A missing, wrong or under-privileged token is the same
``401 unauthorized``. Key names contain ``/``, so actions take the name in the body rather than
in the path.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from broker.api.body import read_json_object, string_field
from broker.api.services import ATTESTATIONS, CLOCK, KEYS, POLICIES, SETTINGS
from broker.attestation.stored import MAX_REASON_CHARS
from broker.config import is_loopback
from broker.core.encoding import b64url_decode
from broker.core.errors import Conflict, ErrorCode, InputError, Unauthorized, UpstreamError
from broker.keys import admin
from broker.keys.material import DEK_BYTES
from broker.policy.freshness import MAX_VERSION, DowngradeTarget

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
BUNDLE_SHA256 = re.compile(r"(?:sha256:)?([0-9a-f]{64})")


def require_role(handler: Handler, role: str) -> Handler:
    """Wrap a handler so that it runs only for a bearer token that holds ``role``."""

    async def guarded(request: web.Request) -> web.StreamResponse:
        request[ADMIN_WHO] = check_admin(request, role)
        return await handler(request)

    return guarded


ADMIN_WHO: web.RequestKey[str] = web.RequestKey("admin_who", str)


def check_admin(request: web.Request, role: str) -> str:
    """Raise ``Unauthorized`` unless the request carries a configured token holding ``role``.

    Returns:
        A name for the caller fit for records: ``token:<first 12 hex of its SHA-256>``.

    Raises:
        Unauthorized: 401 ``unauthorized`` (the same answer for a missing, wrong or
            under-privileged token).
    """
    admin = request.app[SETTINGS].admin
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    token = token.strip()
    # aiohttp decodes header bytes with surrogateescape; a token is printable ASCII (RFC 6750
    # b64token), so anything else simply does not match (it used to raise: a 500).
    usable = token.isascii() and token.isprintable()
    presented = hashlib.sha256(token.encode() if usable else b"").hexdigest()
    roles = admin.roles_of(presented)  # compares against every digest, no early exit
    if scheme.lower() != "bearer" or not usable or not token or role not in roles:
        raise Unauthorized("admin credentials are missing or wrong")
    return f"token:{presented[:12]}"


async def list_keys(request: web.Request) -> web.Response:
    name = request.query.get("name")
    records = await request.app[KEYS].list_versions(name)
    return web.json_response({"keys": [r.describe() for r in records]})


async def create_key(request: web.Request) -> web.Response:
    body = await read_json_object(
        request,
        required=("name", "purpose"),
        optional=("algorithm",),
    )
    record = await request.app[KEYS].create(
        admin.key_name(body["name"]),
        admin.purpose(body["purpose"]),
        algorithm=admin.algorithm(body.get("algorithm")),
        now=request.app[CLOCK](),
        who=request[ADMIN_WHO],
    )
    return web.json_response(record.describe(), status=201)


async def import_key(request: web.Request) -> web.Response:
    """``POST /v1/admin/keys/import`` (role ``key-admin``): a new version of a key (version 1 of
    a new one) from a DEK its owner made, ``{"name", "purpose", "dek": base64url}``; the owner
    encrypts with it only once this answer names the version (``broker weights encrypt
    --url``). Over TLS only, which on a sealed broker ends inside its TEE; the DEK is wrapped by
    the KEK at once and never logged, echoed or recorded."""
    require_tls(request)
    body = await read_json_object(request, required=("name", "purpose", "dek"))
    record = await request.app[KEYS].import_version(
        admin.key_name(body["name"]),
        admin.purpose(body["purpose"]),
        dek_material(body["dek"]),
        now=request.app[CLOCK](),
        who=request[ADMIN_WHO],
    )
    return web.json_response(record.describe(), status=201)


def require_tls(request: web.Request) -> None:
    """Key material only over TLS; plain HTTP only from a loopback peer of a development broker
    (``[server] insecure_http``, itself allowed only on a loopback listener).

    Raises:
        InputError: ``tls_required``.
    """
    server = request.app[SETTINGS].server
    if request.secure or (server.insecure_http and is_loopback(request.remote or "")):
        return
    raise InputError(
        "key material is accepted over TLS only (plain HTTP: a loopback development broker)",
        code=ErrorCode.TLS_REQUIRED,
    )


def dek_material(value: object) -> bytes:
    """32 bytes of AES-256 key material from canonical unpadded base64url (RFC 4648 §5).

    Raises:
        InputError: ``key_material_invalid``; the message never repeats the value.
    """
    try:
        material = b64url_decode(value) if isinstance(value, str) and len(value) == 43 else b""
    except ValueError:
        material = b""
    if len(material) != DEK_BYTES:
        raise InputError(
            "dek must be 32 bytes (AES-256) in unpadded base64url: 43 characters",
            code=ErrorCode.KEY_MATERIAL_INVALID,
        )
    return material


async def rotate_key(request: web.Request) -> web.Response:
    body = await read_json_object(request, required=("name",))
    record = await request.app[KEYS].rotate(
        admin.key_name(body["name"]), now=request.app[CLOCK](), who=request[ADMIN_WHO]
    )
    return web.json_response(record.describe(), status=201)


async def disable_version(request: web.Request) -> web.Response:
    return await _version_action(request, "disable")


async def enable_version(request: web.Request) -> web.Response:
    return await _version_action(request, "enable")


async def destroy_version(request: web.Request) -> web.Response:
    return await _version_action(request, "destroy")


async def _version_action(request: web.Request, action: str) -> web.Response:
    body = await read_json_object(request, required=("name", "version"))
    name, version = admin.key_name(body["name"]), admin.version(body["version"])
    keys, now, who = request.app[KEYS], request.app[CLOCK](), request[ADMIN_WHO]
    if action == "destroy":
        record = await keys.destroy(name, version, now=now, who=who)
    else:
        record = await keys.set_enabled(name, version, action == "enable", now=now, who=who)
    return web.json_response(record.describe())


async def reload_policy(request: web.Request) -> web.Response:
    """``POST /v1/admin/policy/reload`` (role ``policy-admin``): check, test and swap the policy;
    the last good one keeps serving if anything fails. ``{"allow_downgrade": true,
    "to_version": N, "reason": "…"}`` (optionally ``"bundle_sha256"``) lets that signed bundle,
    older than the one in force, go live in every worker, and no other (the only way to roll
    back on purpose); the ``policy_change`` record names who and why."""
    body: dict[str, Any] = {}
    if request.can_read_body:
        body = await read_json_object(
            request,
            required=(),
            optional=("allow_downgrade", "to_version", "bundle_sha256", "reason"),
        )
    target = downgrade_target(body)
    reason = string_field(body, "reason", max_chars=MAX_REASON_CHARS) if target else None
    reloaded = await request.app[POLICIES].reload_everywhere(
        trigger="admin-downgrade" if target else "admin",
        who=request[ADMIN_WHO],
        downgrade=target,
        reason=reason,
    )
    workers = [r.describe() for r in reloaded.reports]
    if reloaded.refused or not reloaded.outcome.ok:
        problems = [r.problem for r in reloaded.refused if r.problem]
        raise Conflict(
            "the new policy was refused; the last good policy keeps serving",
            code=ErrorCode.POLICY_INVALID,
            problem=reloaded.outcome.problem or (problems[0] if problems else None),
            active_digest=reloaded.outcome.digest,
            workers=workers,
        )
    if not reloaded.agreed:
        raise UpstreamError(
            "not every worker confirmed the same policy; reload again (SIGHUP or this endpoint)",
            code=ErrorCode.POLICY_RELOAD_INCOMPLETE,
            active_digest=reloaded.outcome.digest,
            workers=workers,
            silent_workers=list(reloaded.silent),
        )
    return web.json_response(reloaded.describe())


def downgrade_target(body: dict[str, Any]) -> DowngradeTarget | None:
    """The downgrade a reload body asks for: ``None``, or the version (and bytes) it names.

    Raises:
        InputError: ``downgrade_target_required`` for ``allow_downgrade`` without a usable
            ``to_version``; ``bad_request`` for other malformed fields.
    """
    downgrade = body.get("allow_downgrade", False)
    if not isinstance(downgrade, bool):
        raise InputError("allow_downgrade must be a boolean")
    if not downgrade:
        if {"reason", "to_version", "bundle_sha256"} & body.keys():
            raise InputError("reason, to_version and bundle_sha256 go with allow_downgrade: true")
        return None
    version = body.get("to_version")
    if not isinstance(version, int) or isinstance(version, bool) or not 0 < version <= MAX_VERSION:
        raise InputError(
            "a downgrade names its target: to_version, the policy_version to go to",
            code=ErrorCode.DOWNGRADE_TARGET_REQUIRED,
        )
    sha = body.get("bundle_sha256")
    if sha is None:
        return DowngradeTarget(version)
    matched = BUNDLE_SHA256.fullmatch(sha.lower()) if isinstance(sha, str) else None
    if matched is None:
        raise InputError("bundle_sha256 must be sha256:<64 hex digits>")
    return DowngradeTarget(version, "sha256:" + matched.group(1))


async def revoke_attestation(request: web.Request) -> web.Response:
    """``POST /v1/admin/attestations/{jti}/revoke`` (role ``key-admin``): no key is released on
    that result any more, by any worker or replica; logged with who and why."""
    service = request.app[ATTESTATIONS].require()
    body = await read_json_object(request, required=("reason",))
    reason = string_field(body, "reason", max_chars=MAX_REASON_CHARS)
    entry = await service.revoke(
        request.match_info["jti"], reason=reason, who=request[ADMIN_WHO], now=request.app[CLOCK]()
    )
    return web.json_response({"jti": entry.jti, "status": entry.status, "reason": entry.reason})

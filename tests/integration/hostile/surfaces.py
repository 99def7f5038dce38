"""Every other endpoint: query keys, health, metrics, the auditor log API, the admin API."""

from __future__ import annotations

from typing import Any

from tests.integration.hostile.common import (
    ADMIN_TOKEN,
    Case,
    b64std,
)
from tests.support.constants import KEY, QUERY_KEY

# --- query, admin, health, metrics --------------------------------------------------------------


def surface_cases() -> list[Case]:
    public = f"/v1/keys/{QUERY_KEY}/public"
    cases = [
        Case("health.get", "GET", "/healthz", 200, None),
        Case("health.post", "POST", "/healthz", 405, "method_not_allowed", {}),
        Case("health.delete", "DELETE", "/healthz", 405, "method_not_allowed"),
        Case("health.query_string", "GET", "/healthz?x=%00%ff", 200, None),
        Case("ready.get", "GET", "/readyz", 200, None),
        Case("ready.put", "PUT", "/readyz", 405, "method_not_allowed", {}),
        Case("ready.admin", "GET", "/readyz", 200, None, admin=True),  # with its details
        Case(
            "ready.wrong_token",
            "GET",
            "/readyz",
            401,
            "unauthorized",
            headers={"Authorization": "Bearer not-the-admin-token"},
        ),
        Case(
            "ready.basic_auth",
            "GET",
            "/readyz",
            401,
            "unauthorized",
            headers={"Authorization": "Basic YWRtaW46YWRtaW4="},
        ),
        Case("metrics.get", "GET", "/metrics", 200, None),
        Case("metrics.post", "POST", "/metrics", 405, "method_not_allowed", {}),
        Case("openapi.get", "GET", "/openapi.json", 200, None),
        Case("unknown.path", "GET", "/v2/release", 404, "not_found"),
        Case("unknown.traversal", "GET", "/v1/../../etc/passwd", 404, "not_found"),
        Case("unknown.encoded", "GET", "/v1/%2e%2e/admin/keys", 404, "not_found"),
        Case("release.get", "GET", "/v1/release", 405, "method_not_allowed"),
        Case("challenge.get", "GET", "/v1/challenge", 405, "method_not_allowed"),
        Case("challenge.empty", "POST", "/v1/challenge", 200, None),
        Case("challenge.object", "POST", "/v1/challenge", 200, None, {}),
        Case("query.public", "GET", public, 200, None),
        Case("query.public_v1", "GET", public + "?version=1", 200, None),
        Case("query.statement_keys", "GET", "/v1/statement-keys", 200, None),
        Case(
            "query.statement_keys.post", "POST", "/v1/statement-keys", 405, "method_not_allowed", {}
        ),
        Case("query.public.post", "POST", public, 405, "method_not_allowed", {}),
        Case("query.not_a_query_key", "GET", f"/v1/keys/{KEY}/public", 404, "key_unknown"),
        Case("query.unknown_key", "GET", "/v1/keys/models/none/public", 404, "key_unknown"),
        Case("query.upper_case", "GET", "/v1/keys/Models/X/public", 404, "not_found"),
        # the client normalises the path to /v1/keys/x/public, as HTTP clients do
        Case("query.dotdot", "GET", "/v1/keys/models/../x/public", 404, "key_unknown"),
    ]
    for label, version in {
        "abc": "abc",
        "zero": "0",
        "negative": "-1",
        "float": "1.5",
        "superscript": "%C2%B2",
        "huge": "99999999999",
        "empty": "",
        "arabic_digit": "%D9%A1",
    }.items():
        cases.append(
            Case(f"query.version={label}", "GET", f"{public}?version={version}", 400, "bad_request")
        )
    cases.append(Case("query.version=99", "GET", f"{public}?version=99", 404, "key_unknown"))
    return cases


LOG_ROUTES = [
    "/v1/log/key",
    "/v1/log/checkpoint",
    "/v1/log/entries",
    "/v1/log/proof/inclusion?index=0&tree_size=1",
    "/v1/log/proof/consistency?first=1&second=1",
]
AUDITOR_ONLY = {"/v1/log/entries"}  # the records; the key, checkpoints and proofs are public


def log_cases() -> list[Case]:
    cases = [
        Case(f"log{path.split('?')[0]}.auth=none", "GET", path, 401, "unauthorized")
        if path in AUDITOR_ONLY
        else Case(f"log{path.split('?')[0]}.auth=none", "GET", path, 200, None)
        for path in LOG_ROUTES
    ]
    cases += [
        Case(
            f"log{path.split('?')[0]}.post",
            "POST",
            path.split("?")[0],
            405,
            "method_not_allowed",
            {},
        )
        for path in LOG_ROUTES
    ]
    bad = {
        "inclusion.index_missing": "/v1/log/proof/inclusion?tree_size=1",
        "inclusion.beyond": "/v1/log/proof/inclusion?index=0&tree_size=999999999",
        "inclusion.index_eq_size": "/v1/log/proof/inclusion?index=1&tree_size=1",
        "inclusion.negative": "/v1/log/proof/inclusion?index=-1&tree_size=1",
        "inclusion.huge": "/v1/log/proof/inclusion?index=0&tree_size=99999999999999999999",
        "inclusion.unicode_digit": "/v1/log/proof/inclusion?index=%D9%A1&tree_size=2",
        "consistency.zero": "/v1/log/proof/consistency?first=0&second=1",
        "consistency.reversed": "/v1/log/proof/consistency?first=2&second=1",
        "consistency.text": "/v1/log/proof/consistency?first=a&second=b",
        "entries.start_beyond": "/v1/log/entries?start=999999999",
        "entries.start_text": "/v1/log/entries?start=abc",
        "entries.end_negative": "/v1/log/entries?end=-5",
    }
    cases += [
        Case(f"log.{name}", "GET", path, 400, "bad_request", admin=True)
        for name, path in bad.items()
    ]
    cases.append(
        Case("log.entries.ok", "GET", "/v1/log/entries?start=0&end=2", 200, None, admin=True)
    )
    cases.append(Case("log.checkpoint.ok", "GET", "/v1/log/checkpoint", 200, None, admin=True))
    return cases


ADMIN_ROUTES = [
    ("GET", "/v1/admin/keys"),
    ("POST", "/v1/admin/keys"),
    ("POST", "/v1/admin/keys/rotate"),
    ("POST", "/v1/admin/keys/import"),
    ("POST", "/v1/admin/keys/disable"),
    ("POST", "/v1/admin/keys/enable"),
    ("POST", "/v1/admin/keys/destroy"),
]


def admin_cases() -> list[Case]:
    cases = []
    credentials = {
        "none": {},
        "wrong": {"Authorization": "Bearer wrong-token"},
        "basic": {"Authorization": "Basic " + b64std(b"admin:" + ADMIN_TOKEN.encode())},
        "empty_bearer": {"Authorization": "Bearer "},
        "bearer_only": {"Authorization": "Bearer"},
        "token_with_suffix": {"Authorization": f"Bearer {ADMIN_TOKEN}x"},
        "token_prefix": {"Authorization": f"Bearer {ADMIN_TOKEN[:-1]}"},
        "lowercase_scheme_wrong": {"Authorization": "bearer nope"},
    }
    for method, path in ADMIN_ROUTES:
        for label, headers in credentials.items():
            cases.append(
                Case(
                    f"admin{path}.{method}.auth={label}",
                    method,
                    path,
                    401,
                    "unauthorized",
                    {} if method == "POST" else None,
                    headers,
                )
            )
    bodies: list[tuple[str, str, Any, int, str | None]] = [
        (
            "create.purpose_unknown",
            "/v1/admin/keys",
            {"name": "models/a", "purpose": "everything"},
            400,
            "bad_request",
        ),
        (
            "create.purpose_number",
            "/v1/admin/keys",
            {"name": "models/a", "purpose": 1},
            400,
            "bad_request",
        ),
        (
            "create.algorithm_unknown",
            "/v1/admin/keys",
            {"name": "models/a", "purpose": "generic", "algorithm": "DES"},
            400,
            "bad_request",
        ),
        (
            "create.name_bad",
            "/v1/admin/keys",
            {"name": "../x", "purpose": "generic"},
            400,
            "bad_request",
        ),
        (
            "create.name_number",
            "/v1/admin/keys",
            {"name": 5, "purpose": "generic"},
            400,
            "bad_request",
        ),
        ("create.missing_purpose", "/v1/admin/keys", {"name": "models/a"}, 400, "bad_request"),
        (
            "create.unknown_field",
            "/v1/admin/keys",
            {"name": "models/a", "purpose": "generic", "x": 1},
            400,
            "bad_request",
        ),
        ("create.exists", "/v1/admin/keys", {"name": KEY, "purpose": "generic"}, 409, "key_exists"),
        (
            "create.ok",
            "/v1/admin/keys",
            {"name": "models/hostile-created", "purpose": "generic"},
            201,
            None,
        ),
        ("rotate.unknown", "/v1/admin/keys/rotate", {"name": "models/none"}, 404, "key_unknown"),
        ("rotate.name_list", "/v1/admin/keys/rotate", {"name": ["x"]}, 400, "bad_request"),
        ("rotate.empty", "/v1/admin/keys/rotate", {}, 400, "bad_request"),
        ("disable.version_missing", "/v1/admin/keys/disable", {"name": KEY}, 400, "bad_request"),
        (
            "disable.version_bool",
            "/v1/admin/keys/disable",
            {"name": KEY, "version": True},
            400,
            "bad_request",
        ),
        (
            "disable.version_string",
            "/v1/admin/keys/disable",
            {"name": KEY, "version": "1"},
            400,
            "bad_request",
        ),
        (
            "disable.version_null",
            "/v1/admin/keys/disable",
            {"name": KEY, "version": None},
            400,
            "bad_request",
        ),
        (
            "disable.unknown_version",
            "/v1/admin/keys/disable",
            {"name": KEY, "version": 77},
            404,
            "key_unknown",
        ),
        (
            "enable.unknown_key",
            "/v1/admin/keys/enable",
            {"name": "models/none", "version": 1},
            404,
            "key_unknown",
        ),
        (
            "destroy.unknown",
            "/v1/admin/keys/destroy",
            {"name": "models/none", "version": 1},
            404,
            "key_unknown",
        ),
        (
            "destroy.version_float",
            "/v1/admin/keys/destroy",
            {"name": KEY, "version": 1.0},
            400,
            "bad_request",
        ),
        ("create.malformed", "/v1/admin/keys", b"{", 400, "malformed_json"),
        ("create.nested", "/v1/admin/keys", b"[" * 1000 + b"]" * 1000, 400, "malformed_json"),
        ("create.array", "/v1/admin/keys", [], 400, "bad_request"),
    ]
    for name, path, body, status, code in bodies:
        cases.append(Case(f"admin.{name}", "POST", path, status, code, body, admin=True))
    cases.append(Case("admin.list", "GET", "/v1/admin/keys", 200, None, admin=True))
    cases.append(
        Case("admin.list.name_filter", "GET", "/v1/admin/keys?name=%00", 200, None, admin=True)
    )
    cases.append(
        Case(
            "admin.list.post_wrong_type",
            "POST",
            "/v1/admin/keys",
            415,
            "unsupported_media_type",
            b"{}",
            {"Content-Type": "text/plain"},
            admin=True,
        )
    )
    cases.append(
        Case(
            "admin.delete_method", "DELETE", "/v1/admin/keys", 405, "method_not_allowed", admin=True
        )
    )
    return cases

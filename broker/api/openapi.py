"""The OpenAPI 3.1 description of every route, served at ``GET /openapi.json``.

Kept true by tests: every route in ``routes.ROUTES`` is described and nothing else is
(tests/unit/test_openapi.py), every response of the hostile suite validates against it, and
``make test`` runs schemathesis against a live broker (tests/integration/test_schemathesis.py).
Schemas of our own bodies forbid unknown fields, as the handlers do.
"""

from __future__ import annotations

from typing import Any

from broker.api.openapi_schemas import JSON, KEY_NAME_SCHEMA, SCHEMAS, VERSION_SCHEMA
from broker.api.openapi_schemas import object_schema as _object_schema
from broker.api.openapi_schemas import ref as _ref
from broker.attestation.ear import MEDIA_TYPE as EAR_MEDIA_TYPE

_BROKER_ATTESTATION = _object_schema(  # docs/api.md, "Broker attestation"
    {
        "attested": {"type": "boolean"},
        "token": {"type": "string"},
        "token_type": {"enum": ["OIDC", "PKI"]},
        "keys": {"type": "object", "additionalProperties": {"type": "string"}},
        "expires": {"type": "string", "format": "date-time"},
        "reason": {"type": "string"},
    },
    ["attested"],
)


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {JSON: {"schema": schema}}}


def _errors(*statuses: int) -> dict[str, Any]:
    """Error answers an operation documents: the listed ones, and any other 4xx."""
    responses = {str(s): _json(_ref("Error"), "error (see code)") for s in statuses}
    responses["4XX"] = _json(_ref("Error"), "refused input (see code)")
    responses["503"] = _json(_ref("Error"), "a dependency cannot answer; nothing released")
    return responses


def _query(name: str, schema: dict[str, Any], *, required: bool | None = None) -> dict[str, Any]:
    """A query parameter (``required`` left out of the document when None)."""
    parameter: dict[str, Any] = {"name": name, "in": "query", "schema": schema}
    if required is not None:
        parameter["required"] = required
    return parameter


def _body(schema: dict[str, Any], *, required: bool = True) -> dict[str, Any]:
    return {"required": required, "content": {JSON: {"schema": schema}}}


def _admin(summary: str, body: str | None, ok: tuple[int, str], *errors: int) -> dict[str, Any]:
    operation: dict[str, Any] = {
        "summary": summary,
        "tags": ["admin"],
        "security": [{"bearer": []}],
        "responses": {str(ok[0]): _json(_ref(ok[1]), "done"), **_errors(401, *errors)},
    }
    if body is not None:
        operation["requestBody"] = _body(_ref(body))
    return operation


def openapi_document() -> dict[str, Any]:
    """The OpenAPI 3.1 document (a fresh dict each call)."""
    jti = {
        "name": "jti",
        "in": "path",
        "required": True,
        "schema": {"type": "string", "pattern": "^[0-9a-f-]{36}$"},
        "description": "the result's jti (its attestation record's decision_id)",
    }
    public_name = {
        "name": "name",
        "in": "path",
        "required": True,
        "schema": KEY_NAME_SCHEMA,
        "description": "key name; may contain '/'",
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Sealed-runner key broker",
            "version": "1",
            "description": "Attestation-gated release of data keys. Every error has the "
            "Error shape with a stable code; see docs/api.md.",
        },
        "components": {
            "schemas": SCHEMAS,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "paths": {
            "/healthz": {
                "get": {"summary": "liveness", "responses": {"200": _json(_ref("Health"), "up")}}
            },
            "/readyz": {
                "get": {
                    "summary": "readiness, from background checks (details to admins)",
                    "responses": {
                        "200": _json(_ref("Ready"), "ready or degraded"),
                        **_errors(401, 429),
                        "503": _json(_ref("Ready"), "not ready (with the not_ready error)"),
                    },
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    "responses": {
                        "200": {
                            "description": "text exposition format",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        }
                    },
                }
            },
            "/openapi.json": {
                "get": {
                    "summary": "this document",
                    "responses": {"200": _json({"type": "object"}, "OpenAPI 3.1")},
                }
            },
            "/v1/challenge": {
                "post": {
                    "summary": "a single-use nonce",
                    "tags": ["runner"],
                    "requestBody": _body(_object_schema({}, []), required=False),
                    "responses": {
                        "200": _json(_ref("Challenge"), "issued"),
                        **_errors(400, 413, 415),
                    },
                }
            },
            "/v1/release": {
                "post": {
                    "summary": "verify evidence, decide, log, and release a wrapped key; or, "
                    "with Authorization: DPoP <EAR> and a DPoP proof, release keys on an "
                    "attestation result (404 while [attest] is off)",
                    "tags": ["runner"],
                    "parameters": [
                        {
                            "name": "Authorization",
                            "in": "header",
                            "required": False,
                            "description": "DPoP <EAR>: release on an attestation result",
                            "schema": {"type": "string"},
                        },
                        {
                            "name": "DPoP",
                            "in": "header",
                            "required": False,
                            "description": "RFC 9449 proof (with Authorization: DPoP)",
                            "schema": {"type": "string"},
                        },
                    ],
                    "requestBody": _body(
                        {"oneOf": [_ref("ReleaseRequest"), _ref("AttestedReleaseRequest")]}
                    ),
                    "responses": {
                        "200": {
                            **_json(
                                {"oneOf": [_ref("Release"), _ref("AttestedRelease")]}, "released"
                            ),
                            "headers": {"DPoP-Nonce": {"schema": {"type": "string"}}},
                        },
                        **_errors(400, 401, 403, 404, 408, 409, 413, 415),
                    },
                }
            },
            "/v1/attest": {
                "post": {
                    "summary": "verify evidence once; an attestation result (EAR) bound to "
                    "the runner's keys (404 while [attest] is off)",
                    "tags": ["runner"],
                    "requestBody": _body(_ref("AttestRequest")),
                    "responses": {
                        "201": {
                            "description": "the signed EAR (compact JWS)",
                            "headers": {
                                "Location": {"schema": {"type": "string"}},
                                "Broker-Log-Origin": {"schema": {"type": "string"}},
                                "Broker-Log-Index": {"schema": {"type": "string"}},
                            },
                            "content": {EAR_MEDIA_TYPE: {"schema": {"type": "string"}}},
                        },
                        **_errors(400, 401, 403, 404, 408, 413, 415),
                    },
                }
            },
            "/v1/identity": {
                "post": {
                    "summary": "a workload certificate (SPIFFE X.509-SVID) on an attestation "
                    "result under DPoP, for a CSR made in the TEE (404 while [identity] is off)",
                    "tags": ["runner"],
                    "requestBody": _body(
                        {
                            "type": "object",
                            "properties": {"csr": {"type": "string"}},
                            "required": ["csr"],
                        }
                    ),
                    "responses": {
                        "201": _json(
                            {
                                "type": "object",
                                "properties": {
                                    "spiffe_id": {"type": "string"},
                                    "certificates": {"type": "string"},
                                    "serial": {"type": "string"},
                                    "expires_at": {"type": "string", "format": "date-time"},
                                    "attestation": {"type": "string"},
                                    "policy_digest": {"type": "string"},
                                    "log_index": {"type": "integer"},
                                    "log_origin": {"type": "string"},
                                },
                                "required": ["spiffe_id", "certificates", "log_index"],
                            },
                            "the SVID: the leaf, then the intermediates (PEM)",
                        ),
                        **_errors(400, 401, 403, 404, 408, 413, 415),
                    },
                }
            },
            "/v1/identity/bundle": {
                "get": {
                    "summary": "the trust domain's SPIFFE bundle: JWKS (x509-svid keys with "
                    "x5c), or PEM with ?format=pem (404 while [identity] is off)",
                    "tags": ["runner"],
                    "parameters": [
                        _query("format", {"enum": ["jwks", "pem"]}, required=False),
                    ],
                    "responses": {
                        "200": {
                            "description": "the bundle",
                            "content": {
                                JSON: {"schema": {"type": "object"}},
                                "application/x-pem-file": {"schema": {"type": "string"}},
                            },
                        },
                        **_errors(400, 404),
                    },
                }
            },
            "/v1/attestations/{jti}": {
                "get": {
                    "summary": "an attestation result's status (active or revoked); why it "
                    "was revoked only with an auditor or key-admin bearer token",
                    "tags": ["runner"],
                    "parameters": [jti],
                    "responses": {
                        "200": _json(_ref("Attestation"), "the status"),
                        **_errors(401, 404),
                    },
                }
            },
            "/v1/admin/attestations/{jti}/revoke": {
                "post": {
                    **_admin(
                        "revoke an attestation result in the shared store; logged",
                        "Revocation",
                        (200, "Attestation"),
                        400,
                        404,
                    ),
                    "parameters": [jti],
                }
            },
            "/.well-known/broker-attestation": {
                "get": {
                    "summary": "the broker's own attestation token and the keys it binds",
                    "tags": ["runner"],
                    "responses": {
                        "200": _json(_BROKER_ATTESTATION, "attested, or why not"),
                        **_errors(429),
                    },
                }
            },
            "/.well-known/jwks.json": {
                "get": {
                    "summary": "JWKS of the keys that sign attestation results",
                    "tags": ["runner"],
                    "responses": {"200": _json(_ref("Jwks"), "keys"), **_errors()},
                }
            },
            "/v1/keys/{name}/public": {
                "get": {
                    "summary": "a query key's public half with a signed statement",
                    "tags": ["query"],
                    "parameters": [
                        public_name,
                        _query("version", VERSION_SCHEMA, required=False),
                    ],
                    "responses": {
                        "200": _json(_ref("PublicKey"), "the statement"),
                        **_errors(400, 404),
                    },
                }
            },
            "/v1/statement-keys": {
                "get": {
                    "summary": "JWKS of the statement key",
                    "tags": ["query"],
                    "responses": {"200": _json(_ref("Jwks"), "keys"), **_errors()},
                }
            },
            "/v1/admin/keys": {
                "get": {
                    **_admin("list key versions", None, (200, "KeyList")),
                    "parameters": [_query("name", {"type": "string"}, required=False)],
                },
                "post": _admin(
                    "create a key", "CreateKey", (201, "KeyVersion"), 400, 409, 413, 415
                ),
            },
            "/v1/admin/keys/import": {
                "post": _admin(
                    "a new version (version 1 of a new key) from the owner's DEK; TLS only "
                    "(400 tls_required), 32 bytes (400 key_material_invalid)",
                    "ImportKey",
                    (201, "KeyVersion"),
                    400,
                    409,
                    413,
                    415,
                )
            },
            "/v1/admin/keys/rotate": {
                "post": _admin("add a version", "KeyName", (201, "KeyVersion"), 400, 404, 409)
            },
            "/v1/admin/keys/disable": {
                "post": _admin(
                    "disable a version", "KeyNameVersion", (200, "KeyVersion"), 400, 404, 409
                )
            },
            "/v1/admin/keys/enable": {
                "post": _admin(
                    "enable a version", "KeyNameVersion", (200, "KeyVersion"), 400, 404, 409
                )
            },
            "/v1/admin/policy/reload": {
                "post": {
                    **_admin(
                        "swap the policy in every worker; answered once all serve it "
                        "(allow_downgrade with to_version, optionally bundle_sha256, and a "
                        "reason: a deliberate rollback to that older signed bundle, logged with "
                        "who and why; 400 downgrade_target_required without to_version)",
                        None,
                        (200, "PolicyReload"),
                        400,
                        409,
                    ),
                    "tags": ["admin"],
                    "security": [{"bearer": []}],
                    "requestBody": _body(
                        _object_schema(
                            {
                                "allow_downgrade": {"type": "boolean"},
                                "to_version": {
                                    "type": "integer",
                                    "minimum": 1,
                                    "maximum": 9007199254740991,
                                },
                                "bundle_sha256": {
                                    "type": "string",
                                    "pattern": "^(sha256:)?[0-9a-fA-F]{64}$",
                                },
                                "reason": {"type": "string", "minLength": 1, "maxLength": 512},
                            },
                            [],
                        ),
                        required=False,
                    ),
                }
            },
            "/v1/log/key": {
                "get": {
                    "summary": "the note verifier key of the log's checkpoints, its name (the "
                    "origin) and the hand-overs from earlier keys; ?origin=: another replica's",
                    "tags": ["audit"],
                    "parameters": [_query("origin", {"type": "string"})],
                    "responses": {
                        "200": _json(
                            _object_schema(
                                {
                                    "name": {"type": "string"},
                                    "verifier_key": {"type": "string"},
                                    "handovers": {"type": "array", "items": {"type": "string"}},
                                },
                                ["name", "verifier_key", "handovers"],
                            ),
                            "pin this key",
                        ),
                        **_errors(404, 429),
                    },
                }
            },
            "/v1/log/checkpoint": {
                "get": {
                    "summary": "the latest signed checkpoint (C2SP signed note); ?origin=: "
                    "another replica's log",
                    "tags": ["audit"],
                    "parameters": [_query("origin", {"type": "string"})],
                    "responses": {
                        "200": {
                            "description": "a signed note",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        },
                        **_errors(404, 429),
                    },
                }
            },
            "/v1/log/entries": {
                "get": {
                    "summary": "records [start, end) as JSON lines (at most 1000)",
                    "tags": ["audit"],
                    "security": [{"bearer": []}],
                    "parameters": [
                        _query("start", {"type": "integer", "minimum": 0}),
                        _query("end", {"type": "integer", "minimum": 0}),
                    ],
                    "responses": {
                        "200": {
                            "description": "JSON lines, exactly as stored",
                            "content": {"application/x-ndjson": {"schema": {"type": "string"}}},
                        },
                        **_errors(400, 401),
                    },
                }
            },
            "/v1/log/proof/inclusion": {
                "get": {
                    "summary": "inclusion proof (RFC 9162 2.1.3)",
                    "tags": ["audit"],
                    "parameters": [
                        _query("index", {"type": "integer", "minimum": 0}, required=True),
                        _query("tree_size", {"type": "integer", "minimum": 1}, required=True),
                        _query("origin", {"type": "string"}),
                    ],
                    "responses": {
                        "200": _json(_ref("Proof"), "the proof"),
                        **_errors(400, 404, 429),
                    },
                }
            },
            "/v1/log/proof/consistency": {
                "get": {
                    "summary": "consistency proof (RFC 9162 2.1.4)",
                    "tags": ["audit"],
                    "parameters": [
                        _query("first", {"type": "integer", "minimum": 1}, required=True),
                        _query("second", {"type": "integer", "minimum": 1}, required=True),
                        _query("origin", {"type": "string"}),
                    ],
                    "responses": {
                        "200": _json(_ref("Proof"), "the proof"),
                        **_errors(400, 404, 429),
                    },
                }
            },
            "/v1/admin/keys/destroy": {
                "post": _admin(
                    "crypto-shred a version", "KeyNameVersion", (200, "KeyVersion"), 400, 404, 409
                )
            },
        },
    }

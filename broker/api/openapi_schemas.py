"""The component schemas of the OpenAPI document (``openapi.py`` holds the operations): the
bodies our routes accept and answer, each forbidding unknown fields as the handlers do."""

from __future__ import annotations

from typing import Any

from broker.attestation.stored import MAX_REASON_CHARS
from broker.core.errors import ErrorCode
from broker.core.fields import MAX_VERSION
from broker.core.protocol import Algorithm
from broker.crypto.wrap import WRAP_MODES
from broker.decisions.attested_request import MAX_KEYS
from broker.keys.service import KEY_NAME, MAX_KEY_NAME
from broker.keys.store.base import Purpose, VersionState
from broker.stores.nonces import MAX_NONCE_CHARS

JSON = "application/json"
KEY_NAME_SCHEMA = {"type": "string", "pattern": KEY_NAME.pattern, "maxLength": MAX_KEY_NAME}
VERSION_SCHEMA = {"type": "integer", "minimum": 1, "maximum": MAX_VERSION}
LOG_ORIGIN = {
    "type": "string",
    "description": "the origin of the log the record is in (each replica keeps its own)",
}


def ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


WORKER_REPORT: dict[str, Any] = {
    "type": "object",
    "required": ["worker", "digest", "ok"],
    "properties": {
        "worker": {"type": "integer", "minimum": 0},
        "digest": {"type": "string"},
        "ok": {"type": "boolean"},
        "problem": {"type": "string"},
    },
}  # one worker's policy after a reload


def object_schema(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


SCHEMAS: dict[str, Any] = {
    "Error": {
        "type": "object",
        "required": ["error"],
        "additionalProperties": False,
        "properties": {
            "error": {
                "type": "object",
                "required": ["code", "message", "request_id"],
                "properties": {
                    "code": {"type": "string", "enum": sorted(c.value for c in ErrorCode)},
                    "message": {"type": "string"},
                    "request_id": {"type": "string"},
                    "reasons": {"type": "array", "items": {"type": "string"}},
                    "decision_id": {"type": "string"},
                    "checks": {"type": "object"},
                    "problem": {"type": ["string", "null"]},
                    "active_digest": {"type": "string"},
                    "log_index": {"type": "integer", "minimum": 0},
                    "log_origin": LOG_ORIGIN,
                    "workers": {"type": "array", "items": WORKER_REPORT},
                    "silent_workers": {"type": "array", "items": {"type": "integer"}},
                },
            }
        },
    },
    "Challenge": object_schema(
        {
            "nonce": {"type": "string"},
            "expires_at": {"type": "string", "format": "date-time"},
            "audience": {"type": "string"},
        },
        ["nonce", "expires_at", "audience"],
    ),
    "AttestRequest": object_schema(
        {
            "nonce": {"type": "string", "minLength": 1, "maxLength": MAX_NONCE_CHARS},
            "evidence": {
                "type": "object",
                "minProperties": 1,
                "description": "as for a release; binds attestation_thumbprint(runner_key, "
                "pop_key) where a release binds the runner key's thumbprint",
            },
            "runner_key": {
                "type": "object",
                "description": "the encryption key keys are wrapped to (a release's runner_key)",
                "required": ["kty"],
            },
            "pop_key": {
                "type": "object",
                "description": "public EC P-256 JWK: the result's cnf.jwk (DPoP proofs)",
                "required": ["kty"],
            },
        },
        ["nonce", "evidence", "runner_key", "pop_key"],
    ),
    "Attestation": object_schema(
        {
            "jti": {"type": "string"},
            "status": {"type": "string", "enum": ["active", "revoked"]},
            "reason": {
                "type": ["string", "null"],
                "description": "why it was revoked: only with an auditor or key-admin token",
            },
            "expires_at": {"type": "string", "format": "date-time"},
            "identities": {
                "type": "array",
                "description": "workload certificates issued on it, newest last (issue 32)",
                "items": object_schema(
                    {
                        "serial": {"type": "string", "pattern": "^[0-9a-f]{1,40}$"},
                        "spiffe_id": {"type": "string"},
                        "sha256": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
                        "not_after": {"type": "string", "format": "date-time"},
                    },
                    ["serial", "spiffe_id", "sha256", "not_after"],
                ),
            },
        },
        ["jti", "status"],
    ),
    "Revocation": object_schema(
        {"reason": {"type": "string", "minLength": 1, "maxLength": MAX_REASON_CHARS}}, ["reason"]
    ),
    "ReleaseRequest": object_schema(
        {
            "key": KEY_NAME_SCHEMA,
            "version": {**VERSION_SCHEMA, "type": ["integer", "null"]},
            "nonce": {"type": "string", "minLength": 1, "maxLength": MAX_NONCE_CHARS},
            "evidence": {
                "type": "object",
                "minProperties": 1,
                "description": "one of gca/ita (a JWT) and at most one of nras/nvidia",
                "properties": {
                    "gca": {"type": "string"},
                    "ita": {"type": "string"},
                    "nras": {"type": ["array", "string"]},
                    "nvidia": {"type": "object"},
                },
                "additionalProperties": False,
            },
            "runner_key": {
                "type": "object",
                "description": "public JWK (EC P-256/P-384, RSA, OKP X25519) or HPKE hybrid",
                "required": ["kty"],
            },
            "wrap": {"type": "string", "enum": list(WRAP_MODES)},
        },
        ["key", "nonce", "evidence", "runner_key"],
    ),
    "Release": object_schema(
        {
            "key": KEY_NAME_SCHEMA,
            "version": VERSION_SCHEMA,
            "decision_id": {"type": "string"},
            "wrapped_key": {"type": "string"},
            "wrap": {"type": "string", "enum": list(WRAP_MODES)},
            "algorithm": {"type": "string"},
            "log_index": {"type": "integer", "minimum": 0},
            "leaf_hash": {"type": "string", "description": "RFC 6962 leaf hash, base64"},
            "log_origin": LOG_ORIGIN,
        },
        [
            "key",
            "version",
            "decision_id",
            "wrapped_key",
            "wrap",
            "algorithm",
            "log_index",
            "leaf_hash",
            "log_origin",
        ],
    ),
    "AttestedReleaseRequest": object_schema(
        {
            "keys": {
                "type": "array",
                "minItems": 1,
                "maxItems": MAX_KEYS,
                "items": {
                    "oneOf": [
                        KEY_NAME_SCHEMA,
                        object_schema({"key": KEY_NAME_SCHEMA, "version": VERSION_SCHEMA}, ["key"]),
                    ]
                },
            },
            "wrap": {"type": "string", "enum": list(WRAP_MODES)},
        },
        ["keys"],
    ),
    "AttestedRelease": object_schema(
        {
            "release_id": {"type": "string", "description": "in each wrapped key's AAD"},
            "attestation": {"type": "string", "description": "the EAR's jti"},
            "wrap": {"type": "string", "enum": list(WRAP_MODES)},
            "keys": {
                "type": "array",
                "description": "in the order asked: a wrapped key, or that key's error",
                "items": {
                    "type": "object",
                    "required": ["key"],
                    "properties": {
                        "key": KEY_NAME_SCHEMA,
                        "version": {**VERSION_SCHEMA, "type": ["integer", "null"]},
                        "wrapped_key": {"type": "string"},
                        "algorithm": {"type": "string"},
                        "policy_digest": {"type": "string", "description": "in the AAD"},
                        "error": {"type": "object"},
                    },
                },
            },
            "log_index": {"type": "integer", "minimum": 0},
            "leaf_hash": {"type": "string", "description": "RFC 6962 leaf hash, base64"},
            "log_origin": LOG_ORIGIN,
        },
        ["release_id", "attestation", "wrap", "keys", "log_index", "leaf_hash", "log_origin"],
    ),
    "KeyVersion": object_schema(
        {
            "name": KEY_NAME_SCHEMA,
            "version": VERSION_SCHEMA,
            "purpose": {"type": "string", "enum": [p.value for p in Purpose]},
            "algorithm": {"type": "string", "enum": [a.value for a in Algorithm]},
            "state": {"type": "string", "enum": [s.value for s in VersionState]},
            "kek": {"type": "string"},
            "created_at": {"type": "string", "format": "date-time"},
            "updated_at": {"type": ["string", "null"], "format": "date-time"},
        },
        ["name", "version", "purpose", "algorithm", "state", "kek", "created_at", "updated_at"],
    ),
    "KeyList": object_schema(
        {"keys": {"type": "array", "items": ref("KeyVersion")}},
        ["keys"],
    ),
    "CreateKey": object_schema(
        {
            "name": KEY_NAME_SCHEMA,
            "purpose": {"type": "string", "enum": [p.value for p in Purpose]},
            "algorithm": {"type": "string", "enum": [a.value for a in Algorithm]},
        },
        ["name", "purpose"],
    ),
    "ImportKey": object_schema(
        {
            "name": KEY_NAME_SCHEMA,
            "purpose": {
                "type": "string",
                "enum": [Purpose.MODEL_WEIGHTS.value, Purpose.GENERIC.value],
            },
            "dek": {
                "type": "string",
                "pattern": "^[A-Za-z0-9_-]{42}[AEIMQUYcgkosw048]$",
                "description": "the 32-byte DEK the owner made, unpadded base64url",
            },
        },
        ["name", "purpose", "dek"],
    ),
    "KeyName": object_schema({"name": KEY_NAME_SCHEMA}, ["name"]),
    "KeyNameVersion": object_schema(
        {"name": KEY_NAME_SCHEMA, "version": VERSION_SCHEMA}, ["name", "version"]
    ),
    "PublicKey": object_schema(
        {
            "key": KEY_NAME_SCHEMA,
            "version": VERSION_SCHEMA,
            "algorithm": {"type": "string"},
            "statement": {"type": "string", "description": "ES256 JWS over the public key"},
        },
        ["key", "version", "algorithm", "statement"],
    ),
    "Jwks": {
        "type": "object",
        "required": ["keys"],
        "properties": {"keys": {"type": "array", "items": {"type": "object"}}},
    },
    "PolicyReload": object_schema(
        {
            "ok": {"type": "boolean"},
            "trigger": {"type": "string"},
            "time": {"type": "string", "format": "date-time"},
            "active_digest": {"type": "string"},
            "previous_digest": {"type": ["string", "null"]},
            "changed": {"type": "boolean"},
            "problem": {"type": ["string", "null"]},
            "version": {"type": "integer", "description": "policy_version of the signed bundle"},
            "workers": {"type": "array", "items": WORKER_REPORT},
        },
        [
            "ok",
            "trigger",
            "time",
            "active_digest",
            "previous_digest",
            "changed",
            "problem",
            "workers",
        ],
    ),
    "Proof": {
        "type": "object",
        "required": ["hashes"],
        "properties": {
            "index": {"type": "integer"},
            "tree_size": {"type": "integer"},
            "first": {"type": "integer"},
            "second": {"type": "integer"},
            "hashes": {"type": "array", "items": {"type": "string"}},
        },
        "additionalProperties": False,
    },
    "Health": object_schema(
        {
            "status": {"type": "string", "const": "ok"},
            "worker": {"type": "integer", "minimum": 0, "description": "which worker answered"},
        },
        ["status", "worker"],
    ),
    # GET /readyz: ``status`` to anyone; the rest with an admin token; ``error`` when 503.
    "Ready": object_schema(
        {
            "status": {"type": "string", "enum": ["ready", "degraded", "not_ready"]},
            "checks": {"type": "object"},
            "problems": {"type": "array", "items": {"type": "string"}},
            "warnings": {"type": "array", "items": {"type": "string"}},
            "checked_at": {"type": "string"},
            "age_seconds": {"type": "number"},
            "error": {"$ref": "#/components/schemas/Error/properties/error"},
        },
        ["status"],
    ),
}

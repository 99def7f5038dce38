"""The OpenAPI description covers exactly the route table, and is valid OpenAPI 3.1."""

from __future__ import annotations

import re

from broker.api.openapi import openapi_document
from broker.api.routes import ROUTES


def test_every_route_is_described_and_nothing_else() -> None:
    document = openapi_document()
    described = {
        (method.upper(), path)
        for path, operations in document["paths"].items()
        for method in operations
    }
    routed = {(r.method, re.sub(r"\{(\w+):[^}]*\}", r"{\1}", r.path)) for r in ROUTES}
    assert described == routed


def test_every_operation_documents_its_errors_and_admin_security() -> None:
    for path, operations in openapi_document()["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            assert any(code.startswith("2") for code in responses), (method, path)
            if path.startswith("/v1/admin/"):
                assert operation["security"] == [{"bearer": []}]
                assert "401" in responses


def test_document_is_valid_openapi_3_1() -> None:
    from openapi_spec_validator import validate  # noqa: PLC0415

    validate(openapi_document())  # raises on any violation

"""JSON schemas for kubeconform, generated offline from Kubernetes' own OpenAPI (v2) document.

``make test`` copies ``api/openapi-spec/swagger.json`` of the pinned ``k8s.io/kubernetes`` module
(from the Go module proxy) into ``.venv``; this turns it into one standalone schema per kind,
named as kubeconform's ``{{ .ResourceKind }}{{ .KindSuffix }}.json`` template expects
(``statefulset-apps-v1.json``, ``service-v1.json``). What the community's openapi2jsonschema does,
in the form our tests need: every object with declared properties refuses unknown ones
(``additionalProperties: false``, kubeconform's "strict" schemas), and the two string types that
also accept numbers in YAML (``IntOrString``, ``Quantity``) accept both.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

INT_OR_STRING = "io.k8s.apimachinery.pkg.util.intstr.IntOrString"
QUANTITY = "io.k8s.apimachinery.pkg.api.resource.Quantity"


def _strict(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    converted = {key: _strict(value) for key, value in schema.items()}
    if "properties" in converted and "additionalProperties" not in converted:
        converted["additionalProperties"] = False
    return converted


def _references(schema: Any) -> set[str]:
    if isinstance(schema, list):
        return set().union(*(_references(item) for item in schema)) if schema else set()
    if not isinstance(schema, dict):
        return set()
    found = set()
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/definitions/"):
        found.add(ref.removeprefix("#/definitions/"))
    for value in schema.values():
        found |= _references(value)
    return found


def _closure(root: str, definitions: dict[str, Any]) -> dict[str, Any]:
    wanted, queue = {root}, [root]
    while queue:
        for name in _references(definitions[queue.pop()]):
            if name not in wanted:
                wanted.add(name)
                queue.append(name)
    return {name: definitions[name] for name in sorted(wanted)}


def generate(openapi: Path, out: Path, kinds: set[str] | None = None) -> list[Path]:
    """Write one schema per (group, version, kind) into ``out``; only ``kinds`` when given."""
    document = json.loads(openapi.read_text())
    definitions = {name: _strict(schema) for name, schema in document["definitions"].items()}
    definitions[INT_OR_STRING] = {"oneOf": [{"type": "string"}, {"type": "integer"}]}
    definitions[QUANTITY] = {"oneOf": [{"type": "string"}, {"type": "number"}]}
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, schema in document["definitions"].items():
        for gvk in schema.get("x-kubernetes-group-version-kind", []):
            kind = gvk["kind"]
            if kinds is not None and kind not in kinds:
                continue
            group = gvk["group"].split(".")[0].lower()
            suffix = f"-{group}-{gvk['version']}" if group else f"-{gvk['version']}"
            path = out / f"{kind.lower()}{suffix}.json"
            standalone = {
                "$schema": "http://json-schema.org/schema#",
                "$ref": f"#/definitions/{name}",
                "definitions": _closure(name, definitions),
            }
            path.write_text(json.dumps(standalone))
            written.append(path)
    return written


def main(argv: list[str]) -> int:
    """``python -m tests.k8s_schemas OPENAPI OUT``: the schemas ``make deploy-check`` uses."""
    openapi, out = (Path(a) for a in argv)
    print(f"{len(generate(openapi, out))} schemas in {out}")
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))

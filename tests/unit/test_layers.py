"""The layer contract (docs/architecture.md), checked on every import in ``broker/``.

Layers, bottom up: ``core`` (errors, JSON safety, encodings, protocol constants, metrics),
``crypto`` (primitives every domain package and the runner SDK use), ``domain`` (attestation
verifiers and the pure pipeline, policy engine and bundles, audit records and proofs, key
service and its ports), ``adapters`` (network sources, stores, KEKs, cloud clients, the log
writer, configuration), ``entry`` (app, api, CLI, the release service, demo, supervisor).

Rules: an import never runs up a layer; a domain package imports no other domain package (only
``core`` and ``crypto``); the runner SDK (``broker.client``) imports only ``core``, ``crypto`` and
itself; and the graph of packages has no cycle. Every import counts, lazy ones included.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "broker"
CORE, CRYPTO, DOMAIN, ADAPTER, ENTRY = range(5)
NAMES = ("core", "crypto", "domain", "adapters", "entry")

# Longest prefix wins. A module not matched here fails the test (every module has a layer).
LAYER_OF: dict[str, int] = {
    "broker": ENTRY,  # the package itself (version string)
    "broker.core": CORE,
    "broker.crypto": CRYPTO,
    "broker.attestation": DOMAIN,
    "broker.attestation.jwks_sources": ADAPTER,
    "broker.attestation.nvidia.sources": ADAPTER,
    "broker.attestation.service": ADAPTER,
    "broker.policy": DOMAIN,
    "broker.policy.manager": ADAPTER,
    "broker.policy.bundle_source": ADAPTER,
    "broker.policy.bundle_loader": ADAPTER,
    "broker.policy.opa_server": ADAPTER,
    "broker.policy.workers": ADAPTER,
    "broker.policy.testing": ADAPTER,
    "broker.audit": DOMAIN,
    "broker.audit.log": ADAPTER,
    "broker.audit.identity": ADAPTER,
    "broker.audit.segments": ADAPTER,
    "broker.audit.kms_signer": ADAPTER,
    "broker.audit.publisher": ADAPTER,
    "broker.audit.sink": ADAPTER,
    "broker.audit.signers": ADAPTER,
    "broker.audit.witness": ADAPTER,
    "broker.keys": DOMAIN,
    "broker.keys.store": ADAPTER,
    "broker.keys.store.base": DOMAIN,
    "broker.keys.kek": ADAPTER,
    "broker.keys.kek.base": DOMAIN,
    "broker.keys.kek.ring": DOMAIN,
    "broker.keys.factory": ADAPTER,
    "broker.keys.transfer": ADAPTER,
    "broker.nonces": DOMAIN,
    "broker.nonce_stores": ADAPTER,
    "broker.attestation_stores": ADAPTER,
    "broker.attestation_stores_shared": ADAPTER,
    "broker.store_clients": ADAPTER,
    "broker.store_clients_shared": ADAPTER,
    "broker.nonce_stores_shared": ADAPTER,
    "broker.cloud": ADAPTER,
    "broker.config": ADAPTER,
    "broker.config_tables": ADAPTER,
    "broker.client": ENTRY,
    "broker.dev": ENTRY,
    "broker.api": ENTRY,
    "broker.app": ENTRY,
    "broker.release": ENTRY,
    "broker.attest": ENTRY,
    "broker.attested_release": ENTRY,
    "broker.attest_kms": ENTRY,
    "broker.attest_pkcs11": ENTRY,
    "broker.offline": ENTRY,
    "broker.demo": ENTRY,
    "broker.supervisor": ENTRY,
    "broker.cli": ENTRY,
    "broker.cli_audit": ENTRY,
    "broker.cli_audit_query": ENTRY,
    "broker.cli_audit_monitor": ENTRY,
    "broker.cli_dev": ENTRY,
    "broker.cli_docs": ENTRY,
    "broker.cli_status": ENTRY,
    "broker.cli_keys": ENTRY,
    "broker.cli_keys_transfer": ENTRY,
    "broker.cli_policy": ENTRY,
    "broker.cli_weights": ENTRY,
}
SDK = "broker.client"
# I/O libraries only adapters and entry points use: the lower layers are pure.
NETWORK = (
    "aiohttp",
    "grpc",
    "google",
    "redis",
    "asyncpg",
    "urllib.request",
    "http.client",
    "socket",
)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Every broker module ``name`` imports (module-level, lazy and type-only alike).

    ``from broker.x import y`` names the module ``broker.x.y`` when y is a module, and the
    module ``broker.x`` when y is anything else.
    """
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = parts[: len(parts) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in known else target)
    return {module for module in found if module in known and module != name}


def layer_of(name: str) -> int:
    prefixes = [p for p in LAYER_OF if name == p or name.startswith(p + ".")]
    if not prefixes:
        raise KeyError(name)
    return LAYER_OF[max(prefixes, key=len)]


def package_of(name: str) -> str:
    """The unit of the cycle check: ``broker.x`` for a module in a package, else the module."""
    parts = name.split(".")
    return ".".join(parts[:2])


def graph() -> dict[str, set[str]]:
    modules = all_modules()
    known = set(modules)
    return {name: imports_of(name, path, known) for name, path in modules.items()}


def violations(edges: dict[str, set[str]]) -> list[str]:
    found = []
    for source, targets in sorted(edges.items()):
        src_layer = layer_of(source)
        for target in sorted(targets):
            dst_layer = layer_of(target)
            same_package = package_of(source) == package_of(target)
            if dst_layer > src_layer:
                found.append(
                    f"{source} ({NAMES[src_layer]}) imports up: {target} ({NAMES[dst_layer]})"
                )
            elif src_layer == DOMAIN and dst_layer == DOMAIN and not same_package:
                found.append(f"{source} (domain) imports another domain package: {target}")
            elif source.startswith(SDK) and not (
                target.startswith(SDK) or dst_layer in {CORE, CRYPTO}
            ):
                found.append(f"{source} (runner SDK) imports {target}: only core and crypto")
    return found


def package_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    packages: dict[str, set[str]] = defaultdict(set)
    for source, targets in edges.items():
        for target in targets:
            if package_of(source) != package_of(target) and target != "broker":
                packages[package_of(source)].add(package_of(target))
    cycles: list[list[str]] = []
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(packages.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(packages):
        if node not in state:
            visit(node, [node])
    return cycles


def test_every_module_has_a_layer() -> None:
    unassigned = []
    for name in all_modules():
        try:
            layer_of(name)
        except KeyError:
            unassigned.append(name)
    assert unassigned == []


def test_no_import_runs_up_the_layers() -> None:
    assert violations(graph()) == []


def network_imports() -> list[str]:
    found = []
    for name, path in all_modules().items():
        if layer_of(name) > DOMAIN:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                targets = [node.module or ""]
            else:
                continue
            found += [
                f"{name} imports {t}" for t in targets if t.split(".")[0] in NETWORK or t in NETWORK
            ]
    return found


def test_lower_layers_do_no_network_io() -> None:
    """Key-set parsing, OCSP judging and the pipeline are pure; fetching is an adapter's."""
    assert network_imports() == []


def test_no_package_cycle() -> None:
    assert package_cycles(graph()) == []


def test_the_checks_catch_what_they_claim() -> None:
    """The checker itself, on made-up graphs: an upward import, a domain-to-domain import, an SDK
    import of the server, and a cycle are each reported (so a green run means something)."""
    assert violations({"broker.core.errors": {"broker.config"}})
    assert violations({"broker.attestation.pipeline": {"broker.policy.engine"}})
    assert violations({"broker.client.sdk": {"broker.keys.service"}})
    assert not violations({"broker.client.sdk": {"broker.crypto.jwe", "broker.core.binding"}})
    assert not violations({"broker.attestation.gca": {"broker.crypto.jose", "broker.core.errors"}})
    assert package_cycles({"broker.a.x": {"broker.b.y"}, "broker.b.y": {"broker.a.z"}})
    assert not package_cycles({"broker.a.x": {"broker.b.y"}, "broker.b.y": {"broker.c.z"}})
    with pytest.raises(KeyError):
        layer_of("elsewhere.module")

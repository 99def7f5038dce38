"""The layer contract (docs/architecture.md), checked on every import in ``broker/``.

Layers, bottom up: ``core`` (errors, JSON safety, encodings, protocol constants, metrics),
``crypto`` (primitives every domain package and the runner SDK use), ``domain`` (attestation
verifiers and the pure pipeline, policy engine and bundles, audit records and proofs, key
service and its ports), ``adapters`` (network sources, stores, KEKs, cloud clients, the log
writer, configuration), ``entry`` (app, api, CLI, the release service, demo, supervisor).

Rules: an import never runs up a layer; a domain package imports no other domain package (only
``core`` and ``crypto``); the runner SDK (``broker.client``) imports only ``core``, ``crypto`` and
itself; and the graph of packages has no cycle. Every import counts, lazy ones included.

The map (``LAYER_OF``) and the rules' values live in ``tests/support/layers.py``, one copy for
this check and for the table in docs/architecture.md, which a test here keeps equal to them.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

from tests.support import layers
from tests.support.layers import (
    DOC,
    DOMAIN,
    LAYER_OF,
    MAY_IMPORT,
    NAMES,
    NETWORK,
    PURE_UP_TO,
    SDK,
    SDK_MAY_IMPORT,
    all_modules,
    generated_block,
    layer_of,
    package_of,
    render,
)

# The map of modules to layers, LAYER_OF, is in tests/support/layers.py: add a new package there.


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


def graph() -> dict[str, set[str]]:
    modules = all_modules()
    known = set(modules)
    return {name: imports_of(name, path, known) for name, path in modules.items()}


def violations(edges: dict[str, set[str]]) -> list[str]:
    found = []
    sdk_may = " and ".join(NAMES[i] for i in SDK_MAY_IMPORT)
    for source, targets in sorted(edges.items()):
        src_layer = layer_of(source)
        for target in sorted(targets):
            dst_layer = layer_of(target)
            same_package = package_of(source) == package_of(target)
            if dst_layer > src_layer:
                found.append(
                    f"{source} ({NAMES[src_layer]}) imports up: {target} ({NAMES[dst_layer]})"
                )
            elif dst_layer not in MAY_IMPORT[src_layer] and not same_package:
                found.append(
                    f"{source} ({NAMES[src_layer]}) imports another {NAMES[dst_layer]} "
                    f"package: {target}"
                )
            elif source.startswith(SDK) and not (
                target.startswith(SDK) or dst_layer in SDK_MAY_IMPORT
            ):
                found.append(f"{source} (runner SDK) imports {target}: only {sdk_may}")
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


def test_every_line_of_the_map_names_a_module() -> None:
    """A line left behind by a move would document a module that is not there."""
    modules = all_modules()
    stale = [p for p in LAYER_OF if not any(m == p or m.startswith(p + ".") for m in modules)]
    assert stale == [], "remove these from LAYER_OF in tests/support/layers.py"


def test_no_import_runs_up_the_layers() -> None:
    assert violations(graph()) == []


def network_imports() -> list[str]:
    found = []
    for name, path in all_modules().items():
        if layer_of(name) > PURE_UP_TO:
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


def nested_cycles(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Pairs of a package and one of its sub-packages that import each other (a module file
    counts for the package that holds it): ``attestation/`` and ``attestation/nvidia/`` did,
    through generic JOSE helpers now in ``crypto/`` (issue 30)."""
    modules = set(edges) | {t for targets in edges.values() for t in targets}

    def unit(name: str) -> str:
        return name if any(m.startswith(name + ".") for m in modules) else name.rsplit(".", 1)[0]

    nested: dict[str, set[str]] = defaultdict(set)
    for source, targets in edges.items():
        for target in targets:
            a, b = unit(source), unit(target)
            if a != b and (a.startswith(b + ".") or b.startswith(a + ".")):
                nested[a].add(b)
    return sorted((a, b) for a in nested for b in nested[a] if a < b and a in nested.get(b, ()))


def test_no_package_and_sub_package_import_each_other() -> None:
    assert nested_cycles(graph()) == []
    # the check itself: a package and its sub-package importing each other are reported
    looped = {"broker.a.x": {"broker.a.sub.y"}, "broker.a.sub.y": {"broker.a.z"}}
    assert nested_cycles(looped) == [("broker.a", "broker.a.sub")]
    assert nested_cycles({"broker.a.x": {"broker.a.sub.y"}}) == []


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


def test_the_architecture_doc_shows_the_map() -> None:
    """docs/architecture.md's layer table is the map, as it is now."""
    shown = generated_block(DOC.read_text(encoding="utf-8"))
    assert shown == render(), (
        "docs/architecture.md's layer table differs from tests/support/layers.py: "
        "regenerate it with `python -m tests.support.layers --write`"
    )


def test_a_new_package_shows_up_in_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a line of its own a new package is listed under the catch-all (entry); with one,
    in its layer's row. Either way the table changes, so the doc test asks for a regeneration."""
    modules = {**all_modules(), "broker.newkind": Path("broker/newkind/__init__.py")}
    modules["broker.newkind.plan"] = Path("broker/newkind/plan.py")
    assert "`newkind/`" not in render()
    entry_row = render(modules).splitlines()[3]
    assert entry_row.startswith("| **entry**")
    assert "`newkind/`" in entry_row
    monkeypatch.setitem(layers.LAYER_OF, "broker.newkind", DOMAIN)
    domain_row = render(modules).splitlines()[5]
    assert domain_row.startswith("| **domain**")
    assert "`newkind/`" in domain_row
    assert "`newkind/`" not in render(modules).splitlines()[3]

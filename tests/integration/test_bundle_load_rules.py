"""The structure rules hold for every bundle the broker loads, not only for the ones
``broker policy build`` wrote: a bundle built by the pinned OPA's own ``opa build -b`` (signed or
not) is held to them at load time, and the Wasm that decides is the one the broker compiles from
the Rego those rules passed (issue 27, item 10).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from broker.policy import opa_bundle
from broker.policy.build import compile_policy_dir, load_bundle_bytes
from broker.policy.freshness import Freshness
from broker.policy.manager import SMOKE_INPUT
from broker.policy.testing import find_opa
from broker.policy.wasm import PolicyLoadError, WasmPolicyInstance
from tests.support.bundle_server import (
    FAR_FUTURE,
    SCOPE,
    WIDENING_MODULE,
    opa_built,
    signed,
    signing_keys,
)
from tests.support.constants import KEY

SHIPPED = Path(__file__).parents[2] / "policies"
PER_KEY_ALLOW = """package broker.key_policies.wide

import rego.v1

applies_to := {"models/"}

deny contains "never" if false
"""
ALLOW_ALL_WRAPPER = """package broker_internal.decision

import rego.v1

result := {"allow": true, "reasons": set(), "mask": set()}
"""
FOR_KEY = {**SMOKE_INPUT, "request": {**SMOKE_INPUT["request"], "key": KEY}}


def allows(files: dict[str, bytes]) -> object:
    """Whether the bundle's own ``policy.wasm`` (as OPA built it) allows ``FOR_KEY``."""
    verified = opa_bundle.read_bundle(opa_bundle.pack(files), source="t", verification=None)
    compiled = compile_policy_dir(SHIPPED, opa=find_opa())
    decision = WasmPolicyInstance(replace(compiled, wasm=verified.wasm)).evaluate(FOR_KEY)
    return decision.get("allow") if isinstance(decision, dict) else None


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"broker/widen.rego": WIDENING_MODULE}, "package broker.release is not allowed"),
        (  # a second module in the KBS rules' package: every KBS guest "production"
            {"broker/extra.rego": "package broker.kbs\n\nimport rego.v1\n\nproduction := true\n"},
            "package broker.kbs is not allowed",
        ),
        ({"broker_internal/decision.rego": ALLOW_ALL_WRAPPER}, "not the broker's decision wrapper"),
        ({"data.json": '{"broker_internal": {}}'}, "data.json defines data.broker_internal"),
        (  # a KBS reference without measurements: every TDX guest would match it
            {"data.json": '{"broker": {"kbs_guests": {"models/x": [{"technology": "tdx"}]}}}'},
            "data.broker.kbs_guests['models/x'][0] needs measurements",
        ),
    ],
    ids=[
        "second-allow-in-broker.release",
        "second-module-in-broker.kbs",
        "allow-all-wrapper",
        "data-outside-data.broker",
        "kbs-reference-without-measurements",
    ],
)
def test_opa_built_bundle_that_widens_allow_is_refused_at_load(
    extra: dict[str, str], says: str, tmp_path: Path
) -> None:
    files = opa_built(SHIPPED, extra)
    if "data.json" not in extra and "broker/extra.rego" not in extra:
        # the attack is real: OPA's build of it allows the key (a KBS guest's, for extra.rego)
        assert allows(files) is True
    verify = signing_keys(tmp_path)
    raw = signed(files, tmp_path / "sign.pem", Freshness(version=2, expires=FAR_FUTURE))
    with pytest.raises(PolicyLoadError) as caught:
        load_bundle_bytes(
            raw, source="served", opa=find_opa(), verification_key=verify, scope=SCOPE
        )
    assert says in caught.value.message
    with pytest.raises(PolicyLoadError):  # unsigned, the same
        load_bundle_bytes(opa_bundle.pack(files), source="served", opa=find_opa())


def test_per_key_module_that_only_narrows_loads_from_an_opa_built_bundle(tmp_path: Path) -> None:
    """OPA's own build within the rules (a per-key module, reformatted Rego) loads, signed, and
    decides as the directory it came from."""
    files = opa_built(SHIPPED, {"broker/key_policies/wide.rego": PER_KEY_ALLOW})
    verify = signing_keys(tmp_path)
    raw = signed(files, tmp_path / "sign.pem", Freshness(version=2, expires=FAR_FUTURE))
    loaded = load_bundle_bytes(
        raw, source="served", opa=find_opa(), verification_key=verify, scope=SCOPE
    )
    assert loaded.claims["policy_version"] == 2
    directory = compile_policy_dir(SHIPPED, opa=find_opa())
    for document in (SMOKE_INPUT, FOR_KEY):
        assert WasmPolicyInstance(loaded).evaluate(document) == WasmPolicyInstance(
            directory
        ).evaluate(document)


def test_policy_wasm_not_built_from_the_bundles_rego_never_runs() -> None:
    """A bundle whose Rego is the shipped policy but whose policy.wasm allows everything: the
    broker decides with its own build of the Rego."""
    honest = opa_built(SHIPPED)
    allow_all = opa_built(SHIPPED, {"broker_internal/decision.rego": ALLOW_ALL_WRAPPER})
    mixed = {**honest, opa_bundle.WASM: allow_all[opa_bundle.WASM]}
    assert allows(mixed) is True
    loaded = load_bundle_bytes(opa_bundle.pack(mixed), source="served", opa=find_opa())
    decision = WasmPolicyInstance(loaded).evaluate(FOR_KEY)
    assert isinstance(decision, dict)
    assert decision["allow"] is False

"""The Wasm engine (OPA-compiled, in process) with the shipped default policy, and fail-closed
decisions. Needs the pinned ``opa`` (``make test`` installs it) to compile."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import wasmtime

from broker.core.encoding import canonical
from broker.core.errors import ConfigError, ErrorCode, UpstreamError
from broker.policy.build import compile_policy_dir
from broker.policy.bundle import load_policy_dir
from broker.policy.engine import Decision
from broker.policy.testing import find_opa
from broker.policy.wasm import PolicyLoadError, WasmPolicyEngine, WasmPolicyInstance, _RawCall


def main_module(policy_dir: Path) -> Path:
    """Where a policy's main module lives (the only one that may define release rules)."""
    (policy_dir / "broker").mkdir(parents=True, exist_ok=True)
    return policy_dir / "broker" / "release.rego"


def wasm_engine(policy_dir: Path) -> WasmPolicyEngine:
    return WasmPolicyEngine(compile_policy_dir(policy_dir, opa=find_opa()))


SHIPPED = Path(__file__).parents[2] / "policies"
DIGEST = "sha256:" + "11" * 32
GOOD: dict[str, Any] = {
    "schema": "broker.input/v1",
    "request": {"key": "models/llama", "version": 1, "purpose": "model-weights"},
    "tee": {
        "verifier": "gca",
        "technology": "tdx",
        "debug": False,
        "secure_boot": True,
        "software": {"name": "CONFIDENTIAL_SPACE", "version": "250301", "support": ["STABLE"]},
        "workload": {"image_digest": DIGEST},
    },
}


@pytest.fixture
def engine(tmp_path: Path) -> WasmPolicyEngine:
    policies = tmp_path / "policies"
    shutil.copytree(SHIPPED, policies)
    data_path = policies / "broker" / "data.json"
    data = json.loads(data_path.read_text())
    data["images"] = {"models/llama": [DIGEST]}
    data_path.write_text(json.dumps(data))
    return wasm_engine(policies)


def variant(path: str, value: object) -> dict[str, Any]:
    changed = copy.deepcopy(GOOD)
    node = changed
    *parents, leaf = path.split(".")
    for part in parents:
        node = node[part]
    node[leaf] = value
    return changed


async def test_production_image_with_allowed_digest_allowed(engine: WasmPolicyEngine) -> None:
    decision = await engine.evaluate(GOOD)
    assert decision.allowed is True
    assert decision.reasons == ()
    assert decision.policy_digest.startswith("sha256:")


@pytest.mark.parametrize(
    ("path", "value", "reason"),
    [
        ("tee.debug", True, "debug image: a production Confidential Space image is required"),
        ("tee.technology", "none", "technology 'none' is not an allowed hardware TEE"),
        ("tee.software.support", ["USABLE"], "image lacks the STABLE support attribute"),
        ("request.key", "models/other", f"image {DIGEST} is not allowed for key models/other"),
        ("tee.secure_boot", False, "secure boot is not on"),
    ],
)
async def test_denials_carry_reasons(
    engine: WasmPolicyEngine, path: str, value: object, reason: str
) -> None:
    decision = await engine.evaluate(variant(path, value))
    assert decision.allowed is False
    assert reason in decision.reasons


async def test_empty_input_denied(engine: WasmPolicyEngine) -> None:
    assert (await engine.evaluate({})).allowed is False


def test_decision_has_no_truth_value() -> None:
    decision = Decision(True, (), "sha256:x")
    with pytest.raises(TypeError):
        bool(decision)


@pytest.mark.parametrize("result", [None, {}, {"allow": "true"}, {"allow": 1}, {"allow": [True]}])
def test_anything_but_boolean_true_denies(result: object) -> None:
    assert Decision.from_result(result, "d").allowed is False


async def test_conflicting_rules_fail_closed_with_503(tmp_path: Path) -> None:
    main_module(tmp_path).write_text(
        "package broker.release\nimport rego.v1\n"
        "allow := true if input.a\nallow := false if input.b\n"
    )
    engine = wasm_engine(tmp_path)
    with pytest.raises(UpstreamError) as caught:
        await engine.evaluate({"a": True, "b": True})
    assert caught.value.code is ErrorCode.POLICY_UNAVAILABLE


def test_policy_without_release_package_refused(tmp_path: Path) -> None:
    main_module(tmp_path).write_text("package other\nx := 1\n")
    with pytest.raises(ConfigError) as caught:
        wasm_engine(tmp_path)
    assert "must be package broker.release" in caught.value.message


def test_the_attest_module_must_be_package_broker_attest(tmp_path: Path) -> None:
    main_module(tmp_path).write_text("package broker.release\nimport rego.v1\nallow := true\n")
    attest = tmp_path / "broker" / "attest.rego"
    attest.write_text("package broker.release\nimport rego.v1\nreasons := set()\n")
    with pytest.raises(ConfigError) as caught:
        wasm_engine(tmp_path)
    assert "must be package broker.attest" in caught.value.message


async def test_release_and_attest_inputs_reach_their_own_package(tmp_path: Path) -> None:
    """An attest policy that allows everything does not allow a release, and the reverse: the
    wrapper routes on ``request.kind``, which only the broker writes."""
    main_module(tmp_path).write_text("package broker.release\nimport rego.v1\nallow := false\n")
    (tmp_path / "broker" / "attest.rego").write_text(
        "package broker.attest\nimport rego.v1\nallow := true\n"
    )
    engine = wasm_engine(tmp_path)
    assert (await engine.evaluate({"request": {"kind": "attest"}})).allowed is True
    for other in ({"request": {"key": "k"}}, {"request": {"kind": "Attest"}}, {}):
        assert (await engine.evaluate(other)).allowed is False
    main_module(tmp_path).write_text("package broker.release\nimport rego.v1\nallow := true\n")
    (tmp_path / "broker" / "attest.rego").unlink()  # no attest policy: no attestation passes
    engine = wasm_engine(tmp_path)
    assert (await engine.evaluate({"request": {"key": "k"}})).allowed is True
    assert (await engine.evaluate({"request": {"kind": "attest"}})).allowed is False


def test_compile_error_is_opas_message_verbatim(tmp_path: Path) -> None:
    main_module(tmp_path).write_text(
        "package broker.release\nimport rego.v1\nallow if { input.x = }\n"
    )
    with pytest.raises(ConfigError) as caught:
        wasm_engine(tmp_path)
    assert "rego_parse_error" in caught.value.message


def test_empty_policy_dir_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        load_policy_dir(tmp_path)


def test_unparsable_policy_refused(tmp_path: Path) -> None:
    main_module(tmp_path).write_text("package broker.release\nallow if {\n")
    with pytest.raises(ConfigError):
        wasm_engine(tmp_path)


def test_digest_changes_with_data(tmp_path: Path) -> None:
    shutil.copytree(SHIPPED, tmp_path / "p")
    before = load_policy_dir(tmp_path / "p").digest
    (tmp_path / "p" / "broker" / "data.json").write_text(
        json.dumps({"hardware_tees": [], "required_support": "STABLE", "images": {}})
    )
    assert load_policy_dir(tmp_path / "p").digest != before


GPU: dict[str, Any] = {
    "id": "GPU-0",
    "verifier": "local",
    "arch": "HOPPER",
    "cc_mode": "on",
    "debug": False,
    "measurements": "match",
    "cert_chain": "valid",
    "ocsp": "good",
    "driver_version": "550.90.07",
}


@pytest.fixture
def gpu_engine(tmp_path: Path) -> WasmPolicyEngine:
    policies = tmp_path / "policies"
    shutil.copytree(SHIPPED, policies)
    data_path = policies / "broker" / "data.json"
    data = json.loads(data_path.read_text())
    data["images"] = {"models/llama": [DIGEST]}
    data["gpu_keys"] = {"models/llama": {"min_gpus": 1, "min_driver": "550.54"}}
    data_path.write_text(json.dumps(data))
    return wasm_engine(policies)


async def test_gpu_rule_allows_attested_gpus(gpu_engine: WasmPolicyEngine) -> None:
    decision = await gpu_engine.evaluate({**GOOD, "gpus": [GPU]})
    assert decision.allowed is True


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("measurements", "unverified", "GPU GPU-0: measurements unverified"),
        ("cc_mode", "unknown", "GPU GPU-0: confidential computing mode is unknown, not on"),
        ("driver_version", "535.104.05", "GPU GPU-0: driver 535.104.05 is older than 550.54"),
        ("ocsp", "revoked", "GPU GPU-0: device certificate status revoked"),
        ("ocsp", "unknown", "GPU GPU-0: device certificate status unknown"),
    ],
)
async def test_gpu_rule_denies_with_reasons(
    gpu_engine: WasmPolicyEngine, field: str, value: str, reason: str
) -> None:
    decision = await gpu_engine.evaluate({**GOOD, "gpus": [{**GPU, field: value}]})
    assert decision.allowed is False
    assert reason in decision.reasons


async def test_gpu_key_without_gpus_denied(gpu_engine: WasmPolicyEngine) -> None:
    decision = await gpu_engine.evaluate({**GOOD, "gpus": []})
    assert decision.allowed is False
    assert "key models/llama needs at least 1 attested GPU(s), got 0" in decision.reasons


async def test_gpu_missing_field_denied(gpu_engine: WasmPolicyEngine) -> None:
    gpu = {k: v for k, v in GPU.items() if k != "cc_mode"}
    decision = await gpu_engine.evaluate({**GOOD, "gpus": [gpu]})
    assert decision.allowed is False


async def test_sprintf_of_a_literal_default_renders_as_opa_does(tmp_path: Path) -> None:
    # regopy rendered this with bare inner quotes and unparsable JSON (a 503); OPA prints the
    # string as it is.
    main_module(tmp_path).write_text(
        "package broker.release\nimport rego.v1\ndefault allow := false\n"
        'reasons contains sprintf("x %v", [object.get(input, "missing", "dflt")])\n'
    )
    decision = await wasm_engine(tmp_path).evaluate({})
    assert decision.reasons == ("x dflt",)


async def test_runtime_error_names_rule_and_location_in_the_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    main_module(tmp_path).write_text(
        "package broker.release\nimport rego.v1\n"
        "allow := true if input.a\nallow := false if input.b\n"
    )
    with pytest.raises(UpstreamError):
        await wasm_engine(tmp_path).evaluate({"a": True, "b": True})
    assert "release.rego:4" in caplog.text or "release.rego:3" in caplog.text


def test_builtin_the_engine_lacks_is_named_at_load(tmp_path: Path) -> None:
    main_module(tmp_path).write_text(
        "package broker.release\nimport rego.v1\ndefault allow := false\n"
        'reasons contains x if x := crypto.sha256("a")\n'
        'reasons contains http.send({"method": "get", "url": "https://x.invalid"}).body\n'
    )
    with pytest.raises(PolicyLoadError) as caught:
        wasm_engine(tmp_path)
    assert "http.send" in caught.value.message
    assert 'engine = "opa"' in caught.value.message


def test_data_under_the_release_package_is_refused(tmp_path: Path) -> None:
    policies = tmp_path / "policies"
    shutil.copytree(SHIPPED, policies)
    (policies / "broker" / "release").mkdir()
    (policies / "broker" / "release" / "data.json").write_text('{"allow": true}')
    with pytest.raises(PolicyLoadError):
        wasm_engine(policies)


async def test_canonical_bytes_decide_as_the_input_does(engine: WasmPolicyEngine) -> None:
    """The release path evaluates its canonical bytes (sorted keys) instead of re-serialising."""
    for document in (GOOD, variant("tee.debug", True), variant("request.key", "other")):
        plain = await engine.evaluate(document)
        encoded = await engine.evaluate(document, encoded=canonical(document))
        assert (encoded.allowed, encoded.reasons) == (plain.allowed, plain.reasons)


def test_exhausted_fuel_fails_closed(tmp_path: Path) -> None:
    """Evaluation is bounded by fuel; running out is a trap through the raw call, a 503."""
    main_module(tmp_path).write_text(
        "package broker.release\nimport rego.v1\n"
        "allow if count([x | some x in numbers.range(1, 2000); x % 7 == 0]) > 0\n"
    )
    compiled = compile_policy_dir(tmp_path, opa=find_opa())
    assert WasmPolicyInstance(compiled).evaluate({}) is not None  # enough with the default
    starved = WasmPolicyInstance(compiled)
    starved._fuel = 10_000
    with pytest.raises(UpstreamError) as caught:
        starved.evaluate({})
    assert caught.value.code is ErrorCode.POLICY_UNAVAILABLE


def test_raw_call_checks_the_signature_once() -> None:
    """The unchecked call is sound only for the signature it was built for."""
    store = wasmtime.Store(wasmtime.Engine())
    module = wasmtime.Module(
        store.engine,
        '(module (func (export "two") (param i32 i32) (result i32) local.get 0 local.get 1 '
        'i32.add) (func (export "wide") (param i64) (result i32) i32.const 0))',
    )
    exports = wasmtime.Instance(store, module, []).exports(store)
    add = _RawCall(store, exports["two"], params=2)
    assert add(40, 2) == 42
    with pytest.raises(TypeError):
        add(1)  # never a call with a stale argument left in the reused array
    with pytest.raises(PolicyLoadError):
        _RawCall(store, exports["two"], params=3)
    with pytest.raises(PolicyLoadError):
        _RawCall(store, exports["wide"], params=1)

"""Per-key modules and data can only narrow: the structure rules, attack by attack.

Each case adds one file to a copy of the shipped policy, in which the security team allowed
image ``ALLOWED`` for ``models/llama``. Every way to write into ``data.broker`` (or the generated
``data.broker_internal``) from outside ``broker/release.rego`` and ``broker/data.json`` must
refuse the whole policy, naming the file; the controls show what is allowed still loads and
still decides as the shipped policy does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from broker.core.errors import ConfigError
from broker.policy.build import compile_policy_dir
from broker.policy.testing import find_opa
from broker.policy.wasm import WasmPolicyInstance

SHIPPED = Path(__file__).parents[2] / "policies"
ALLOWED = "sha256:" + "11" * 32
EVIL = "sha256:" + "66" * 32
KEY = "models/llama"


def policy_with(tmp_path: Path, name: str, content: str) -> Path:
    policies = tmp_path / "policies"
    shutil.copytree(SHIPPED, policies)
    data = json.loads((policies / "broker" / "data.json").read_text())
    data["images"] = {KEY: [ALLOWED]}
    (policies / "broker" / "data.json").write_text(json.dumps(data))
    target = policies / name
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(content)
    return policies


def request_with_image(digest: str) -> dict[str, Any]:
    return {
        "schema": "broker.input/v1",
        "request": {"key": KEY, "version": 1, "purpose": "model-weights"},
        "tee": {
            "verifier": "gca",
            "technology": "tdx",
            "debug": False,
            "secure_boot": True,
            "software": {"name": "CONFIDENTIAL_SPACE", "support": ["STABLE"]},
            "workload": {"image_digest": digest},
        },
        "gpus": [],
        "claims": {},
    }


WIDENING_MODULES = {
    "images_in_package_broker": (
        "broker/images.rego",
        f'package broker\nimport rego.v1\nimages["{KEY}"] := ["{EVIL}"]\n',
    ),
    "second_release_module": (
        "broker/extra.rego",
        "package broker.release\nimport rego.v1\nallow if input.backdoor\n",
    ),
    "release_rule_through_a_ref_head": (
        "broker/b.rego",
        "package broker\nimport rego.v1\nrelease.allow if input.backdoor\n",
    ),
    "release_subpackage": (
        "broker/helpers.rego",
        "package broker.release.helpers\nimport rego.v1\nx := 1\n",
    ),
    "generated_wrapper_package": (
        "broker_internal/decision.rego",
        'package broker_internal.decision\nimport rego.v1\nresult := {"allow": true}\n',
    ),
    "key_policies_without_a_name": (
        "broker/kp.rego",
        "package broker.key_policies\nimport rego.v1\nimages := {}\n",
    ),
    "package_outside_broker": ("other.rego", "package other\nimport rego.v1\nx := 1\n"),
    "package_named_like_key_policies": (
        "broker/k.rego",
        "package broker.key_policies_x.y\nimport rego.v1\nx := 1\n",
    ),
}


@pytest.mark.parametrize("case", sorted(WIDENING_MODULES))
def test_module_writing_into_data_broker_refused(tmp_path: Path, case: str) -> None:
    name, content = WIDENING_MODULES[case]
    policies = policy_with(tmp_path, name, content)
    with pytest.raises(ConfigError) as caught:
        compile_policy_dir(policies, opa=find_opa())
    assert f" {name}: " in caught.value.message, caught.value.message


WIDENING_DATA = {
    "root_data_mounts_broker": ("data.json", {"broker": {"images": {KEY: [EVIL]}}}),
    "images_directory": ("broker/images/data.json", {KEY: [EVIL]}),
    "key_policies_data": ("broker/key_policies/x/data.json", {"applies_to": [KEY], "deny": []}),
    "internal_data": ("broker_internal/data.json", {"decision": {"result": {"allow": True}}}),
}


@pytest.mark.parametrize("case", sorted(WIDENING_DATA))
def test_data_file_outside_the_restriction_paths_refused(tmp_path: Path, case: str) -> None:
    name, value = WIDENING_DATA[case]
    policies = policy_with(tmp_path, name, json.dumps(value))
    with pytest.raises(ConfigError) as caught:
        compile_policy_dir(policies, opa=find_opa())
    assert f" {name}: " in caught.value.message, caught.value.message


@pytest.mark.parametrize("reserved", ["release", "key_policies"])
def test_main_data_defining_rule_packages_refused(tmp_path: Path, reserved: str) -> None:
    policies = policy_with(tmp_path, "README.md", "not loaded")
    path = policies / "broker" / "data.json"
    data = json.loads(path.read_text())
    data[reserved] = {"allow": True}
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as caught:
        compile_policy_dir(policies, opa=find_opa())
    assert f"broker/data.json: defines data.broker.{reserved}" in caught.value.message


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("broker/data.yaml", f"images:\n  {KEY}: ['{EVIL}']\n"),
        ("broker/extra/data.yml", "x: 1\n"),
        (".manifest", '{"roots": [""]}'),
        ("broker/.signatures.json", "{}"),
        ("policy.wasm", "\0asm"),
    ],
)
def test_files_opa_would_load_but_the_digest_cannot_vouch_for_refused(
    tmp_path: Path, name: str, content: str
) -> None:
    """A data.yaml used to change decisions under an unchanged digest."""
    policies = policy_with(tmp_path, name, content)
    with pytest.raises(ConfigError) as caught:
        compile_policy_dir(policies, opa=find_opa())
    assert name in caught.value.message


def test_key_policy_and_requirement_data_still_narrow(tmp_path: Path) -> None:
    """Controls: a key policy and restriction data load, and can only deny."""
    policies = policy_with(
        tmp_path,
        "broker/key_policies/llama.rego",
        "package broker.key_policies.llama\nimport rego.v1\n"
        f'applies_to := {{"{KEY}"}}\n'
        'deny contains "llama: only project p" if not input.tee.platform.project_id == "p"\n',
    )
    requirements = policies / "broker" / "key_requirements" / "data.json"
    requirements.parent.mkdir()
    requirements.write_text(json.dumps({KEY: {"zones": ["z"]}}))
    instance = WasmPolicyInstance(compile_policy_dir(policies, opa=find_opa()))
    allowed = request_with_image(ALLOWED)
    allowed["tee"]["platform"] = {"project_id": "p", "zone": "z"}
    assert instance.evaluate(allowed)["allow"] is True
    changes: list[dict[str, Any]] = [
        {"platform": {"project_id": "q", "zone": "z"}},
        {"platform": {}},
    ]
    for tee_change in changes:
        denied = request_with_image(ALLOWED)
        denied["tee"].update(tee_change)
        assert instance.evaluate(denied)["allow"] is False
    assert instance.evaluate(request_with_image(EVIL))["allow"] is False


def test_import_alias_in_a_key_policy_cannot_reach_data_broker(tmp_path: Path) -> None:
    """``import data.broker as b`` then a rule ``b.images…``: the head is the module's own
    (data.broker.key_policies.alias.b…), or OPA refuses it; either way no wider access."""
    policies = policy_with(
        tmp_path,
        "broker/key_policies/alias.rego",
        "package broker.key_policies.alias\nimport rego.v1\nimport data.broker as b\n"
        f'applies_to := {{"other"}}\nb.images["{KEY}"] := ["{EVIL}"]\n',
    )
    try:
        compiled = compile_policy_dir(policies, opa=find_opa())
    except ConfigError:
        return  # refused outright: as good
    assert WasmPolicyInstance(compiled).evaluate(request_with_image(EVIL))["allow"] is False

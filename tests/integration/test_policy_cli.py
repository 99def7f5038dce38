"""``broker policy check|fmt|test|eval|replay|build`` as a security team runs them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from broker.policy.build import load_bundle, run_opa
from broker.policy.testing import find_opa
from broker.policy.wasm import PolicyLoadError
from tests.policy_helpers import EXAMPLE, signing_pair
from tests.policy_helpers import policy_copy as copy_policy
from tests.support.cli import run

DIGEST = "sha256:" + "ab" * 32


def policy_copy(tmp_path: Path, *, example: bool = False) -> Path:
    return copy_policy(tmp_path / "policies", extra=EXAMPLE if example else None)


def good_input(key: str = "models/llama") -> dict[str, object]:
    return {
        "schema": "broker.input/v1",
        "request": {"key": key, "version": 1, "purpose": "model-weights"},
        "tee": {
            "verifier": "gca",
            "technology": "tdx",
            "debug": False,
            "secure_boot": True,
            "software": {"name": "CONFIDENTIAL_SPACE", "support": ["STABLE"]},
            "workload": {"image_digest": DIGEST},
            "platform": {"project_id": "prod-project"},
        },
        "gpus": [],
    }


def test_check_passes_and_lints_unknown_input_paths(tmp_path: Path) -> None:
    policies = policy_copy(tmp_path)
    ok = run("policy", "check", str(policies))
    assert ok.returncode == 0, ok.stderr
    assert "input lint: 0 warning(s)" in ok.stdout
    (policies / "broker" / "key_policies").mkdir()
    (policies / "broker" / "key_policies" / "typo.rego").write_text(
        'package broker.key_policies.typo\nimport rego.v1\napplies_to := {"models/x"}\n'
        'deny contains "x" if input.tee.workload.image_digst == "y"\n'
    )
    linted = run("policy", "check", str(policies))
    assert linted.returncode == 0
    assert "input.tee.workload.image_digst is not set by the broker" in linted.stdout
    strict = run("policy", "check", "--strict", str(policies))  # what a CI job runs
    assert strict.returncode == 1
    assert "--strict: warnings fail the check" in strict.stderr


def test_check_refuses_a_module_that_widens_access(tmp_path: Path) -> None:
    policies = policy_copy(tmp_path)
    (policies / "broker" / "backdoor.rego").write_text(
        "package broker.release\nimport rego.v1\nallow if input.please\n"
    )
    refused = run("policy", "check", str(policies))
    assert refused.returncode == 2
    assert "broker/backdoor.rego: package broker.release is not allowed" in refused.stderr


def test_check_refuses_a_kbs_reference_without_measurements(tmp_path: Path) -> None:
    """It would match every guest of its technology: refused before any guest asks, naming it
    (the shipped policy also lets it match nothing)."""
    for guests in (
        {"models/llama": [{"technology": "tdx"}]},
        {"models/llama": [{"technology": "tdx", "measurement": {"mrtd": "aa"}}]},
    ):
        policies = copy_policy(tmp_path / "p", kbs_guests=guests)
        refused = run("policy", "check", str(policies))
        assert refused.returncode == 2, refused.stdout
        assert "broker/data.json: data.broker.kbs_guests['models/llama'][0]" in refused.stderr
        shutil.rmtree(policies)
    pinned = {"models/llama": [{"technology": "tdx", "measurements": {"mrtd": "aa"}}]}
    assert (
        run("policy", "check", str(copy_policy(tmp_path / "p", kbs_guests=pinned))).returncode == 0
    )


def test_fmt_check_fails_on_unformatted_rego(tmp_path: Path) -> None:
    policies = policy_copy(tmp_path)
    assert run("policy", "fmt", str(policies), "--check").returncode == 0
    path = policies / "broker" / "release.rego"
    path.write_text(path.read_text().replace("\tconfidential_space\n", "  confidential_space\n", 1))
    assert run("policy", "fmt", str(policies), "--check").returncode == 1
    assert run("policy", "fmt", str(policies)).returncode == 0
    assert run("policy", "fmt", str(policies), "--check").returncode == 0


def test_policy_test_runs_opa_and_the_broker_engine(tmp_path: Path) -> None:
    policies = policy_copy(tmp_path, example=True)
    passed = run("policy", "test", str(policies))
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert "0 difference(s) with the broker's engine" in passed.stdout
    assert "PASS broker/key_policy_tests/mistral/test_other_keys_are_not_narrowed" in passed.stdout
    (policies / "broker" / "failing_test.rego").write_text(
        "package broker.failing_test\nimport rego.v1\ntest_wrong if data.broker.release.allow\n"
    )
    failed = run("policy", "test", str(policies))
    assert failed.returncode == 1
    assert "FAIL broker/failing_test/test_wrong" in failed.stdout
    for test_file in policies.rglob("*_test.rego"):
        test_file.unlink()
    untested = run("policy", "test", str(policies))
    assert untested.returncode == 1
    assert untested.stdout == ""  # it used to print "[]"
    assert "no tests in" in untested.stderr


def test_eval_prints_the_decision_and_explains_it(tmp_path: Path) -> None:
    policies = policy_copy(tmp_path)
    data = json.loads((policies / "broker" / "data.json").read_text())
    data["images"] = {"models/llama": [DIGEST]}
    (policies / "broker" / "data.json").write_text(json.dumps(data))
    document = tmp_path / "input.json"
    document.write_text(json.dumps(good_input()))
    result = run("policy", "eval", "--policy", str(policies), "--input", str(document))
    assert result.returncode == 0, result.stderr
    decision = json.loads(result.stdout)
    assert (decision["allow"], decision["reasons"]) == (True, [])
    assert decision["policy_digest"].startswith("sha256:")
    explained = run(
        "policy", "eval", "--policy", str(policies), "--input", str(document), "--explain"
    )
    assert "Enter data.broker.release" in explained.stderr  # OPA's own trace


def attestation_input(digest: str) -> dict[str, object]:
    """``good_input``'s TEE running ``digest``, as an attestation's input (``request.kind``)."""
    document = json.loads(json.dumps(good_input()))
    document["request"] = {"kind": "attest"}
    document["tee"]["workload"]["image_digest"] = digest
    return dict(document)


def test_replay_reports_changed_decisions(tmp_path: Path) -> None:
    policies = policy_copy(tmp_path, example=True)
    log = tmp_path / "decisions.log"
    records = [
        {"type": "release", "decision_id": "d1", "time": "2026-11-20T10:00:00+00:00",
         "key": "models/mistral", "result": "allow", "reasons": [],
         "input": {**good_input("models/mistral"), "gpus": []}},
        {"type": "release", "decision_id": "d2", "time": "2026-11-21T10:00:00+00:00",
         "key": "models/llama", "result": "deny", "reasons": ["old reason"],
         "input": good_input()},
        {"type": "release", "decision_id": "d3", "time": "2026-11-22T10:00:00+00:00",
         "key": "models/llama", "result": "deny", "code": "token_expired", "input": None},
        {"type": "policy_change", "time": "2026-11-22T11:00:00+00:00"},
        # an attestation the attest policy allowed; the candidate's images list it for no key
        {"type": "attestation", "decision_id": "a1", "time": "2026-11-23T10:00:00+00:00",
         "result": "allow", "reasons": [],
         "input": attestation_input("sha256:" + "9" * 64)},
    ]  # fmt: skip
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    data = json.loads((policies / "broker" / "data.json").read_text())
    data["images"] = {"models/llama": [DIGEST], "models/mistral": [DIGEST]}
    (policies / "broker" / "data.json").write_text(json.dumps(data))
    result = run("policy", "replay", "--log", str(log), "--policy", str(policies))
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    summary = lines[-1]["summary"]
    assert summary == {
        "decisions": 3, "unchanged": 0, "allow_to_deny": 2, "deny_to_allow": 1,
        "spiffe_id_changed": 0, "reasons_changed": 0, "skipped": 1,
    }  # fmt: skip
    changed = {line["decision_id"]: line for line in lines[:-1]}
    assert changed["a1"]["type"] == "attestation"  # decided by data.broker.attest
    assert changed["a1"]["new"]["reasons"] == [
        "image sha256:" + "9" * 64 + " is not allowed for any key"
    ]
    assert changed["d1"]["new"]["reasons"] == [
        "models/mistral: needs a GPU in confidential-computing mode"
    ]
    since = run(
        "policy", "replay", "--log", str(log), "--policy", str(policies),
        "--since", "2026-11-21T00:00:00Z", "--key", "models/llama",
    )  # fmt: skip
    assert json.loads(since.stdout.splitlines()[-1])["summary"]["decisions"] == 1


def test_build_signs_and_a_tampered_bundle_is_refused(tmp_path: Path) -> None:
    policies = policy_copy(tmp_path)
    signing_pair(tmp_path)
    bundle = tmp_path / "bundle.tar.gz"
    built = run(
        "policy", "build", str(policies), "-o", str(bundle), "--scope", "test", "--signing-key",
        str(tmp_path / "sign.pem"),
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    loaded = load_bundle(
        bundle, opa=find_opa(), verification_key=tmp_path / "verify.pem", scope="test"
    )
    assert loaded.digest.startswith("sha256:")
    (tmp_path / "other").mkdir()
    _, other = signing_pair(tmp_path / "other")
    try:
        load_bundle(bundle, opa=find_opa(), verification_key=other, scope="test")
    except PolicyLoadError as exc:
        assert "signature does not verify" in exc.message  # noqa: PT017 - the message is the point
    else:
        raise AssertionError("a bundle signed by another key was accepted")
    unsigned = tmp_path / "unsigned.tar.gz"
    assert run("policy", "build", str(policies), "-o", str(unsigned)).returncode == 0
    try:
        load_bundle(
            unsigned, opa=find_opa(), verification_key=tmp_path / "verify.pem", scope="test"
        )
    except PolicyLoadError:
        pass
    else:
        raise AssertionError("an unsigned bundle was accepted where a signature is required")


def test_build_signs_scope_version_and_expiry_for_the_pipeline(tmp_path: Path) -> None:
    """``broker policy build`` as the team's pipeline runs it: the signature names the
    environment and carries policy_version and policy_expires; a signed build without a scope
    is refused (brokers would refuse its bundle)."""
    policies = policy_copy(tmp_path)
    signing_pair(tmp_path)
    bundle = tmp_path / "bundle.tar.gz"
    sign = ("--signing-key", str(tmp_path / "sign.pem"))
    built = run(
        "policy", "build", str(policies), "-o", str(bundle), *sign, "--scope", "prod",
        "--version", "42", "--expires-in", "2d", env={"SOURCE_DATE_EPOCH": "1800000000"},
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    printed = json.loads(built.stdout)
    assert (printed["scope"], printed["policy_version"]) == ("prod", 42)
    assert printed["policy_expires"] == "2027-01-17T08:00:00+00:00"  # 1800000000 + 2 days
    loaded = load_bundle(
        bundle, opa=find_opa(), verification_key=tmp_path / "verify.pem", scope="prod"
    )
    assert (loaded.claims["policy_version"], loaded.claims["policy_expires"]) == (
        42, 1_800_000_000 + 2 * 86400,
    )  # fmt: skip
    opa_verifies = run_opa(  # OPA's own reader ignores the claims it does not know
        find_opa(), "build", "-b", str(bundle), "--verification-key", str(tmp_path / "verify.pem"),
        "--signing-alg", "ES256", "--scope", "prod", "-o", str(tmp_path / "opa.tar.gz"),
    )  # fmt: skip
    assert opa_verifies.returncode == 0, opa_verifies.stderr
    with pytest.raises(PolicyLoadError, match="scope does not match"):
        load_bundle(
            bundle, opa=find_opa(), verification_key=tmp_path / "verify.pem", scope="staging"
        )
    default = run("policy", "build", str(policies), "-o", str(bundle), *sign, "--scope", "prod",
                  env={"SOURCE_DATE_EPOCH": "1800000000"})  # fmt: skip
    assert json.loads(default.stdout)["policy_version"] == 1_800_000_000  # the build time
    unscoped = run("policy", "build", str(policies), "-o", str(bundle), *sign)
    assert unscoped.returncode == 2
    assert "--scope" in unscoped.stderr

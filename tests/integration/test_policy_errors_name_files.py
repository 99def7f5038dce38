"""Issue 28 item 10: a policy that does not compile is reported in the user's own file names —
the policy directory's module, or the bundle and the module inside it — never the private
temporary copy the broker compiles from (``/tmp/broker-policy-…``), by ``broker policy eval``
and by a reload of the running broker alike."""

from __future__ import annotations

import asyncio
import tarfile
from pathlib import Path
from typing import Any

from broker.policy import opa_bundle
from tests.integration.conftest import RunningBroker
from tests.integration.test_policy_reload import admin_env, reload
from tests.support.cli import run

BROKEN = (
    'package broker.key_policies.typo\n\nimport rego.v1\n\ndeny contains "x" if { input.x == }\n'
)
STAGED = ("broker-policy-", "broker-bundle-", "/policy/broker/")


def assert_names_the_users_file(message: str, expected: str) -> None:
    assert expected in message, message
    for staged in STAGED:
        assert staged not in message, message


def test_eval_of_a_broken_directory_names_its_module(tmp_path: Path) -> None:
    policies = tmp_path / "my-policies"
    made = run("dev", "init", str(tmp_path / "ws"), "--image", "sha256:" + "1f" * 32)
    assert made.returncode == 0, made.stderr
    (tmp_path / "ws" / "policies").rename(policies)
    (policies / "broker" / "typo.rego").write_text(BROKEN)
    (tmp_path / "input.json").write_text("{}")
    done = run("policy", "eval", "--policy", str(policies), "--input", str(tmp_path / "input.json"))
    assert done.returncode == 2
    assert_names_the_users_file(done.stderr, f"{policies}/broker/typo.rego:5")


def test_eval_of_a_broken_bundle_names_the_bundle_and_its_module(tmp_path: Path) -> None:
    made = run("dev", "init", str(tmp_path / "ws"), "--image", "sha256:" + "1f" * 32)
    assert made.returncode == 0, made.stderr
    good = tmp_path / "good.tar.gz"
    assert (
        run("policy", "build", str(tmp_path / "ws" / "policies"), "-o", str(good)).returncode == 0
    )
    with tarfile.open(good) as archive:
        files = {
            m.name.lstrip("/"): archive.extractfile(m).read()  # type: ignore[union-attr]
            for m in archive.getmembers()
            if m.isfile()
        }
    files["broker/typo.rego"] = BROKEN.encode()
    bundle = tmp_path / "candidate.tar.gz"
    bundle.write_bytes(opa_bundle.pack(files))
    (tmp_path / "input.json").write_text("{}")
    done = run("policy", "eval", "--policy", str(bundle), "--input", str(tmp_path / "input.json"))
    assert done.returncode == 2
    assert_names_the_users_file(done.stderr, f"{bundle}:broker/typo.rego")


async def test_a_failed_reload_names_the_policy_file(start_broker: Any) -> None:
    broker: RunningBroker = await start_broker(environ=admin_env())
    module = broker.workdir / "policies" / "broker" / "typo.rego"
    await asyncio.to_thread(module.write_text, BROKEN)
    status, body = await reload(broker)
    assert (status, body["error"]["code"]) == (409, "policy_invalid")
    assert_names_the_users_file(body["error"]["problem"], f"{module}:5")
    (failure,) = [r for r in broker.records() if r["type"] == "policy_reload_failed"]
    assert_names_the_users_file(failure["problem"], f"{module}:5")

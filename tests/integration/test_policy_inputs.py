"""Every ``broker policy`` command takes the same three inputs, and one digest names a policy.

Issue 28, items 3 and 4. A newcomer ran ``broker policy check`` and ``test`` on the kubelet's
ConfigMap layout (``..data`` link, ``..<timestamp>/`` directory, one link per item) and OPA
loaded every module twice; bundles made with OPA's own tools (``opa build -b … --signing-key``:
names with a leading ``/``; ``opa sign`` + ``tar czf b.tar.gz .``: a ``./`` directory entry and
``./`` names) were refused; and ``--revision`` gave the bundle another digest than the
directory's. Here every command runs as a user runs it (a subprocess of ``broker``), the
bundles are made by the pinned ``opa`` and the system's ``tar``, and a broker serves them.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from broker.policy.structure import WRAPPER, WRAPPER_PACKAGE
from broker.policy.testing import find_opa
from broker.policy.wasm import ENTRYPOINT
from tests.integration.conftest import RunningBroker
from tests.integration.test_kubernetes_policy_volume import kubelet_volume
from tests.integration.test_policy_cli import good_input
from tests.integration.test_policy_reload import admin_env, readyz
from tests.policy_helpers import policy_copy, signing_pair
from tests.support.constants import KEY

pytestmark = pytest.mark.timeout(300)
SCOPE = "test"
STAMP = "2026_12_02_10_00_00.000000001"


def broker(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``broker ARGS`` as a user runs it: its own process, the pinned OPA on ``BROKER_OPA``."""
    return subprocess.run(
        [sys.executable, "-m", "broker.cli", *args],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        cwd=cwd,
        env={**os.environ, "BROKER_OPA": str(find_opa())},
    )


def digest_of_check(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, done.stderr
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("policy digest: ")]
    return line.removeprefix("policy digest: ")


def opa(*args: str, cwd: Path) -> None:
    done = subprocess.run(
        [str(find_opa()), *args], cwd=cwd, capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


def opa_source(policies: Path) -> Path:
    """The policy as a team hands it to OPA's own ``opa build -b``: the broker's decision
    wrapper beside the modules (docs/policy.md, "Bundles")."""
    (policies / WRAPPER_PACKAGE).parent.mkdir(parents=True, exist_ok=True)
    (policies / WRAPPER_PACKAGE).write_text(WRAPPER)
    return policies


def claims(directory: Path) -> Path:
    path = directory / "claims.json"
    path.write_text(
        json.dumps({"scope": SCOPE, "policy_version": 7, "policy_expires": 4_000_000_000})
    )
    return path


def opa_build_signed(source: Path, out: Path, keys: Path) -> Path:
    """``opa build -b -t wasm --signing-key``: OPA names every entry ``/…``."""
    opa(
        *("build", "-b", "-t", "wasm", "-e", ENTRYPOINT, "--ignore", "*_test.rego"),
        *("--signing-key", str(keys / "sign.pem"), "--claims-file", str(claims(keys))),
        *("-o", str(out), "."),
        cwd=source,
    )
    return out


def opa_sign_and_tar(source: Path, out: Path, keys: Path) -> Path:
    """An unsigned ``opa build -b``, unpacked, ``opa sign`` in it, then ``tar czf b.tar.gz .``:
    a ``./`` directory entry, directory entries, and ``./`` names."""
    unsigned = out.with_name("unsigned-" + out.name)
    opa(
        *("build", "-b", "-t", "wasm", "-e", ENTRYPOINT, "--ignore", "*_test.rego"),
        *("-o", str(unsigned), "."),
        cwd=source,
    )
    tree = out.with_name(out.name + ".d")
    tree.mkdir()
    subprocess.run(["tar", "xzf", str(unsigned), "-C", str(tree)], check=True, timeout=60)
    opa("sign", "--signing-key", str(keys / "sign.pem"), "--claims-file", str(claims(keys)),
        "--bundle", ".", cwd=tree)  # fmt: skip
    subprocess.run(["tar", "czf", str(out), "."], cwd=tree, check=True, timeout=60)
    listing = subprocess.run(
        ["tar", "tzf", str(out)], capture_output=True, text=True, check=True, timeout=60
    )
    assert listing.stdout.splitlines()[0] == "./"  # the shape that used to be refused
    return out


# --- item 3: the same inputs everywhere ---------------------------------------------------------


def test_every_policy_command_reads_the_configmap_layout_as_the_directory(tmp_path: Path) -> None:
    """check and test used to hand the mount to OPA, which loaded ``..<stamp>/broker/…`` and
    ``broker/…`` both (``multiple default rules``); each command now reads ``..data`` once."""
    plain = policy_copy(tmp_path / "policies")
    volume = tmp_path / "volume"
    kubelet_volume(volume, plain, STAMP)
    (tmp_path / "input.json").write_text(json.dumps(good_input()))
    (tmp_path / "decisions.log").write_text("")
    digest = digest_of_check(broker("policy", "check", str(plain)))
    assert digest_of_check(broker("policy", "check", str(volume))) == digest
    tested = broker("policy", "test", str(volume))
    assert tested.returncode == 0, tested.stderr
    assert "0 difference(s) with the broker's engine" in tested.stdout
    assert str(volume / f"..{STAMP}") not in tested.stdout + tested.stderr
    formatted = broker("policy", "fmt", "--check", str(volume))
    assert formatted.returncode == 0, formatted.stdout + formatted.stderr
    rewrite = broker("policy", "fmt", str(volume))
    assert rewrite.returncode == 2
    assert "is a ConfigMap mount: fmt rewrites files in the source directory" in rewrite.stderr
    assert len(rewrite.stderr.strip().splitlines()) == 1
    evaluated = broker(
        "policy", "eval", "--policy", str(volume), "--input", str(tmp_path / "input.json"),
        "--explain",
    )  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr
    assert json.loads(evaluated.stdout)["policy_digest"] == digest
    replayed = broker("policy", "replay", "--policy", str(volume), "--log",
                      str(tmp_path / "decisions.log"))  # fmt: skip
    assert replayed.returncode == 0, replayed.stderr
    assert json.loads(replayed.stdout.splitlines()[-1])["policy_digest"] == digest
    built = broker("policy", "build", str(volume), "-o", str(tmp_path / "b.tar.gz"))
    assert built.returncode == 0, built.stderr
    assert json.loads(built.stdout)["policy_digest"] == digest


def test_a_bundle_is_an_input_of_every_policy_command(tmp_path: Path) -> None:
    """A bundle for check (held to the load rules), test (which says a bundle carries no tests
    and where they are), fmt --check, eval --explain, replay and build (signed again)."""
    plain = policy_copy(tmp_path / "policies")
    signing_pair(tmp_path)
    bundle = tmp_path / "b.tar.gz"
    built = broker("policy", "build", str(plain), "-o", str(bundle))
    digest = json.loads(built.stdout)["policy_digest"]
    assert digest_of_check(broker("policy", "check", str(bundle))) == digest
    tested = broker("policy", "test", str(bundle))
    assert tested.returncode == 1
    assert "a bundle carries none" in tested.stderr
    assert broker("policy", "fmt", "--check", str(bundle)).returncode == 0
    rewrite = broker("policy", "fmt", str(bundle))
    assert (rewrite.returncode, "is a bundle" in rewrite.stderr) == (2, True)
    (tmp_path / "input.json").write_text(json.dumps(good_input()))
    explained = broker("policy", "eval", "--policy", str(bundle), "--input",
                       str(tmp_path / "input.json"), "--explain")  # fmt: skip
    assert explained.returncode == 0, explained.stderr
    assert json.loads(explained.stdout)["policy_digest"] == digest
    assert "data.broker.release" in explained.stderr  # OPA's trace, from the bundle's Rego
    signed = tmp_path / "signed.tar.gz"
    resigned = broker("policy", "build", str(bundle), "-o", str(signed), "--revision", "r2",
                      "--signing-key", str(tmp_path / "sign.pem"), "--scope", SCOPE)  # fmt: skip
    assert resigned.returncode == 0, resigned.stderr
    assert (
        json.loads(resigned.stdout)["policy_digest"],
        json.loads(resigned.stdout)["revision"],
    ) == (digest, "r2")
    unverified = broker("policy", "check", str(signed))
    assert unverified.returncode == 2
    assert "no [policy] bundle_verification_key" in unverified.stderr
    verified = broker("policy", "check", str(signed), "--verification-key",
                      str(tmp_path / "verify.pem"), "--scope", SCOPE)  # fmt: skip
    assert digest_of_check(verified) == digest


@pytest.mark.parametrize("made_by", ["opa build --signing-key", "opa sign + tar czf ."])
async def test_bundles_made_with_opas_own_tools_load_in_the_cli_and_the_server(
    made_by: str, start_broker: Any, tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    keys.mkdir()
    signing_pair(keys, "rsa")
    out = tmp_path / "opa-made.tar.gz"
    make = opa_build_signed if made_by.startswith("opa build") else opa_sign_and_tar

    def made_from_the_served_policy(workdir: Path) -> None:
        source = opa_source(Path(shutil.copytree(workdir / "policies", tmp_path / "source")))
        make(source, out, keys)

    served: RunningBroker = await start_broker(
        workdir_setup=made_from_the_served_policy,
        environ={
            "BROKER_POLICY_BUNDLE": str(out),
            "BROKER_POLICY_BUNDLE_VERIFICATION_KEY": str(keys / "verify.pem"),
            "BROKER_POLICY_BUNDLE_VERIFICATION_SCOPE": SCOPE,
        },
    )
    async with served.client() as client:
        assert len((await client.release(KEY, served.token_source())).dek) == 32
    trust = ("--verification-key", str(keys / "verify.pem"), "--scope", SCOPE)
    digest = digest_of_check(await asyncio.to_thread(broker, "policy", "check", str(out), *trust))
    assert served.records()[-1]["policy_digest"] == digest
    (tmp_path / "input.json").write_text(json.dumps(good_input(KEY)))
    evaluated = await asyncio.to_thread(
        broker, "policy", "eval", "--policy", str(out), "--input", str(tmp_path / "input.json"),
        *trust,
    )  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr
    assert json.loads(evaluated.stdout)["policy_digest"] == digest


def test_a_bundle_that_widens_access_is_refused_by_check_whoever_made_it(tmp_path: Path) -> None:
    """The same load rules in ``check`` as in ``serve``: an OPA-made, validly signed bundle with
    a second ``broker.release`` module is refused, naming the file inside the bundle."""
    keys = tmp_path / "keys"
    keys.mkdir()
    signing_pair(keys, "rsa")
    source = opa_source(policy_copy(tmp_path / "policies"))
    (source / "broker" / "widen.rego").write_text(
        "package broker.release\n\nimport rego.v1\n\nallow if input.please\n"
    )
    out = opa_build_signed(source, tmp_path / "widening.tar.gz", keys)
    refused = broker("policy", "check", str(out), "--verification-key",
                     str(keys / "verify.pem"), "--scope", SCOPE)  # fmt: skip
    assert refused.returncode == 2
    assert f"{out}: broker/widen.rego" in refused.stderr
    assert "package broker.release is not allowed" in refused.stderr


# --- item 4: one digest -------------------------------------------------------------------------


async def test_one_digest_from_directory_to_bundles_readyz_and_records(
    start_broker: Any, tmp_path: Path
) -> None:
    """The digest names the policy, not its packaging or label: the directory (check), its
    bundle built without and with ``--revision``, signed or not (build and check of each), what
    ``/readyz`` shows an admin and the ``policy_change`` record's ``new_digest`` are one value;
    the revision is logged beside it."""
    signing_pair(tmp_path)
    builds = {
        "unsigned": (),
        "unsigned-revision": ("--revision", "c0ffee"),
        "signed": ("--signing-key", str(tmp_path / "sign.pem"), "--scope", SCOPE),
        "signed-revision": ("--signing-key", str(tmp_path / "sign.pem"), "--scope", SCOPE,
                            "--revision", "c0ffee"),
    }  # fmt: skip
    trust = ("--verification-key", str(tmp_path / "verify.pem"), "--scope", SCOPE)
    digests: dict[str, str] = {}

    def build_every_way(workdir: Path) -> None:
        digests["directory"] = digest_of_check(broker("policy", "check", str(workdir / "policies")))
        for name, flags in builds.items():
            out = tmp_path / f"{name}.tar.gz"
            built = broker("policy", "build", str(workdir / "policies"), "-o", str(out), *flags)
            assert built.returncode == 0, built.stderr
            digests[f"build {name}"] = json.loads(built.stdout)["policy_digest"]
            checked = broker(
                "policy", "check", str(out), *(trust if name.startswith("signed") else ())
            )
            digests[f"check {name}"] = digest_of_check(checked)

    served: RunningBroker = await start_broker(
        workdir_setup=build_every_way,
        environ={
            **admin_env(),
            "BROKER_POLICY_BUNDLE": str(tmp_path / "signed-revision.tar.gz"),
            "BROKER_POLICY_BUNDLE_VERIFICATION_KEY": str(tmp_path / "verify.pem"),
            "BROKER_POLICY_BUNDLE_VERIFICATION_SCOPE": SCOPE,
        },
    )
    digest = digests["directory"]
    assert digests == dict.fromkeys(digests, digest)
    assert (await readyz(served))["checks"]["policy"] == digest
    (change,) = [r for r in served.records() if r["type"] == "policy_change"]
    assert (change["new_digest"], change["revision"]) == (digest, "c0ffee")
    async with served.client() as client:
        await client.release(KEY, served.token_source())
    assert served.records()[-1]["policy_digest"] == digest

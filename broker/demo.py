"""``broker demo``: the whole product on loopback, on embedded defaults.

1. Make a work directory: dev TLS material, a development issuer's JWKS, a policy directory
   (the shipped Rego plus data allowing one image digest for the demo key) and ``broker.toml``.
2. Load that config through the normal validation, create the key (local development KEK).
3. The model owner encrypts a model directory (a ``.safetensors`` file and its config) with
   ``broker weights encrypt`` (the CLI, as a subprocess); a loopback HTTPS server plays the
   storage bucket that holds the encrypted files.
4. Start the broker over TLS on 127.0.0.1 (a free port).
5. A sealed runner with the allowed image gets the key through ``broker.client``, reads one
   tensor straight from storage with random access (``open_encrypted``: only the segments it
   needs are fetched and decrypted), then streams the whole file (``decrypt_to``) and checks it
   against the manifest; a runner with another image is denied with the policy's reasons.
6. Attest once, release many: the runner attests (``POST /v1/attest``: an EAR bound to a PoP key
   and an encryption key made in the runner) and releases the weights key and a query key on
   that one result (``Authorization: DPoP``, no evidence sent again).
7. The security team withdraws the allowed image (a per-key policy, and off the allow-list) and
   reloads through the admin API (checked, tested, swapped): the reload revokes the attestation
   the new policy refuses; the full-evidence runner is denied with the new reason, and the next
   release on the attestation is refused with the revocation's reason.
8. An auditor fetches the signed checkpoint and proves the allowed decision is included in it,
   through the audit API.
   Then two runners attest, get workload certificates (SPIFFE X.509-SVIDs) and exchange a
   message over mTLS; a third, unattested client is refused at the handshake
   (``broker/demo_identity.py``); and a Confidential Containers guest fetches the demo key
   over the KBS protocol with sample evidence (``broker/demo_kbs.py``).
9. Verify the decision log: creation, allow, deny, attestation, releases on it, the policy
   change, the revocation, the denials; chain intact.
10. With ``--workdir DIR``, leave DIR a ``broker dev`` workspace (its issuer in ``dev-issuer.json``,
    the image allowed again) for ``broker serve`` and ``broker dev token DIR``, and end with the
    URL of its auditor console once served and the token to log in (``make demo`` keeps its
    workspace in ``build/demo``).

Returns True only if every step happened as expected.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import secrets
import shutil
import socket
import ssl
import struct
import sys
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric import ec

from broker.api.server import BrokerRunner
from broker.app import create_app, server_ssl_context
from broker.audit.log import DecisionLog
from broker.audit.segments import verify_file
from broker.client import Attestation, BrokerClient, BrokerClientError, BrokerIdentity
from broker.client.weights import decrypt_to, open_encrypted, open_source
from broker.config import Settings, load_settings
from broker.crypto.checkpoint import NoteVerifier, parse_checkpoint
from broker.crypto.merkle import leaf_hash, verify_inclusion
from broker.crypto.wrap import key_id
from broker.demo_identity import IDENTITY_TOML, SPIFFE_PATH, runners_talk, write_identity_ca
from broker.demo_kbs import KBS_TOML, allow_sample_guests, guest_fetches
from broker.dev.issuer import ISSUER_FILE, DevIssuer, DevTokenSource, Workload
from broker.dev.launcher import DevLauncher, serve_dev_launcher
from broker.dev.workspace import allow_images, write_dev_workspace, write_private_pem
from broker.keys.factory import open_key_service
from broker.keys.store.base import Purpose
from broker.signers.checkpoint import open_checkpoint_signer

DEMO_KEY = "models/demo-llama"
DEMO_QUERY_KEY = "queries/demo-chat"  # a query key: its HPKE private half is released
AUDIENCE = "https://broker.demo.invalid"
ALLOWED_DIGEST = "sha256:" + hashlib.sha256(b"sealed-runner:1.0").hexdigest()
# the broker's own image, as the development launcher attests it (`make image` gives the real one)
BROKER_DIGEST = "sha256:" + hashlib.sha256(b"sealed-broker:demo").hexdigest()
OTHER_DIGEST = "sha256:" + hashlib.sha256(b"tampered-runner:6.6").hexdigest()


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def utc_now() -> datetime:
    return datetime.now(UTC)


def _say(step: str, text: str) -> None:
    print(f"[{step}] {text}", flush=True)


async def run_demo(workdir: Path | None) -> bool:
    """Run every step; print a few lines; True only if all happened as expected."""
    auditor_token = secrets.token_urlsafe(24)  # the auditor's: the console of the workspace
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="broker-demo-") as tmp:
            return await _run(Path(tmp), auditor_token)
    workdir.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - once, before serving
    ok = await _run(workdir, auditor_token)
    if ok:  # the workdir is kept: leave it a `broker dev` workspace to keep experimenting in
        await asyncio.to_thread(_reopen_workspace, workdir, auditor_token)
    return ok


async def _run(workdir: Path, auditor_token: str) -> bool:
    issuer = DevIssuer(dev_mode=True)
    admin_token = secrets.token_urlsafe(24)  # the security team's, for the reload step
    await asyncio.to_thread(workdir.mkdir, parents=True, exist_ok=True)
    for name in ("result-signing.pem", "statement-signing.pem"):  # EAR and query statements
        await asyncio.to_thread(_p256_pem, workdir / name)
    config = write_dev_workspace(
        workdir,
        issuer,
        audience=AUDIENCE,
        images={DEMO_KEY: [ALLOWED_DIGEST], DEMO_QUERY_KEY: [ALLOWED_DIGEST]},
        now=utc_now(),
        keys_extra={"signing_key": "statement-signing.pem"},
        extra_toml=f'[admin]\ntoken_sha256 = ["{_sha256(admin_token)}"]\n\n'
        f'[[admin.tokens]]\nsha256 = "{_sha256(auditor_token)}"\nroles = ["auditor"]\n\n'
        '[attest]\nenabled = true\nsigning_key = "result-signing.pem"\n'
        + IDENTITY_TOML
        + KBS_TOML.format(key=DEMO_KEY),
        identities={ALLOWED_DIGEST: SPIFFE_PATH},
    )
    await asyncio.to_thread(write_identity_ca, workdir)
    await asyncio.to_thread(allow_sample_guests, workdir, DEMO_KEY)
    await asyncio.to_thread(issuer.save, workdir / ISSUER_FILE)  # as `broker dev init`
    listening = socket.socket()  # bound first: DPoP proofs name its URL ([server] public_urls)
    listening.bind(("127.0.0.1", 0))
    port = listening.getsockname()[1]
    public = f"{AUDIENCE},https://127.0.0.1:{port}"
    launcher_dir = Path(tempfile.mkdtemp(prefix="bd-"))  # short: a socket path is <= 107 bytes
    sealed = {
        "BROKER_SEALED_LAUNCHER_SOCKET": str(launcher_dir / "teeserver.sock"),
        # the demo's later steps read its key files; a deployed sealed broker makes its keys
        # inside the TEE instead (make_keys, docs/deploy.md "A sealed broker")
        "BROKER_SEALED_MAKE_KEYS": "false",
    }
    settings = load_settings(config, environ={"BROKER_SERVER_PUBLIC_URLS": public, **sealed})
    _say("setup", f"config {config} (TLS on loopback, development issuer {issuer.issuer})")
    try:
        async with serve_dev_launcher(
            DevLauncher(issuer, Workload(image_digest=BROKER_DIGEST)),
            launcher_dir / "teeserver.sock",
        ):
            return await _serve_demo(workdir, settings, config, issuer, listening, admin_token)
    finally:
        await asyncio.to_thread(shutil.rmtree, launcher_dir, ignore_errors=True)


async def _serve_demo(  # noqa: PLR0917 - the demo's state, passed on once
    workdir: Path,
    settings: Settings,
    config: Path,
    issuer: DevIssuer,
    listening: socket.socket,
    admin_token: str,
) -> bool:
    port = listening.getsockname()[1]

    change_log = DecisionLog(settings.audit.log, replica=settings.server.replica_id)
    await change_log.open()
    try:
        async with open_key_service(
            settings.keys, create_missing_kek=True, change_log=change_log.append_entry
        ) as keys:
            await keys.create(DEMO_KEY, Purpose.MODEL_WEIGHTS, now=utc_now())
            await keys.create(DEMO_QUERY_KEY, Purpose.QUERY, now=utc_now())
    finally:
        await change_log.close()
    if not await _owner_encrypts(workdir, config):
        return False

    storage = await _storage_server(workdir / "bucket", workdir)
    runner = BrokerRunner(create_app(settings), settings.server)
    await runner.setup()
    site = web.SockSite(runner, listening, ssl_context=server_ssl_context(settings))
    await site.start()
    client_tls = ssl.create_default_context(cafile=str(workdir / "tls" / "ca.pem"))
    ok = False
    expected = BrokerIdentity(
        image_digests=frozenset({BROKER_DIGEST}),
        jwks=json.dumps(issuer.jwks()),
        audience=AUDIENCE,
        issuer=issuer.issuer,
    )
    try:
        async with BrokerClient(
            f"https://127.0.0.1:{port}", ssl_context=client_tls, broker_identity=expected
        ) as client:
            if not await _broker_verified(client):
                return False
            ok = await _runners(client, issuer, storage.url, client_tls, workdir)
            attestation = await _attest_once(client, issuer) if ok else None
            good = DevTokenSource(issuer, Workload(image_digest=ALLOWED_DIGEST), utc_now)
            if attestation is not None and not await runners_talk(client, good, _say):
                return False
            base = f"https://127.0.0.1:{port}"
            if attestation is not None and not await guest_fetches(
                base, client_tls, settings, DEMO_KEY, _say
            ):
                return False
            ok = (
                attestation is not None
                and await _policy_reload(
                    client,
                    issuer,
                    workdir=workdir,
                    base=base,
                    admin_token=admin_token,
                    tls=client_tls,
                )
                and await _revoked(attestation)
            )
            ok = ok and await _prove_through_api(settings, base, admin_token, client_tls)
    finally:
        await runner.cleanup()
        await storage.runner.cleanup()
    return ok and _audit(settings.audit.log)


def demo_safetensors(layers: int = 8, width: int = 256) -> bytes:
    """A small ``.safetensors`` file (8-byte header length, JSON header, raw F32 data)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for layer in range(layers):
        size = width * width * 4
        header[f"layer.{layer}.weight"] = {
            "dtype": "F32",
            "shape": [width, width],
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    data = b"".join(
        struct.pack(f"<{width * width}f", *([float(layer)] * width * width))
        for layer in range(layers)
    )
    return struct.pack("<Q", len(encoded)) + encoded + data


async def _owner_encrypts(workdir: Path, config: Path) -> bool:
    model, bucket = workdir / "model", workdir / "bucket"
    await asyncio.to_thread(model.mkdir, exist_ok=True)
    await asyncio.to_thread((model / "model.safetensors").write_bytes, demo_safetensors())
    await asyncio.to_thread((model / "config.json").write_text, '{"architectures": ["Demo"]}')
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "broker.cli",
        "weights",
        "encrypt",
        str(model),
        str(bucket),
        "--key",
        DEMO_KEY,
        "--config",
        str(config),
        "--segment-size",
        "65536",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await process.communicate()
    if process.returncode != 0:
        _say("owner", f"FAILED: broker weights encrypt: {err.decode()[-500:]}")
        return False
    files = json.loads(out)["files"]
    _say(
        "owner",
        f"created {DEMO_KEY} v1; `broker weights encrypt {model.name}/ {bucket.name}/` sealed "
        f"{', '.join(f['path'] for f in files)} ({sum(f['size'] for f in files)} bytes) "
        "and wrote manifest.json",
    )
    return True


@dataclass
class Storage:
    runner: web.AppRunner
    url: str


async def _storage_server(bucket: Path, workdir: Path) -> Storage:
    """A loopback HTTPS server standing in for the bucket (ranged GETs, like Cloud Storage)."""
    app = web.Application()
    app.router.add_static("/bucket/", bucket)
    runner = web.AppRunner(app)
    await runner.setup()
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    await asyncio.to_thread(
        tls.load_cert_chain, workdir / "tls" / "server.pem", workdir / "tls" / "server.key"
    )
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls)
    await site.start()
    return Storage(runner, f"https://127.0.0.1:{runner.addresses[0][1]}/bucket")


def _read_tensor(
    url: str, dek: bytes, kid: str, name: str, tls: ssl.SSLContext
) -> tuple[Any, int, int]:
    """Random access: the safetensors header, then one tensor's bytes; nothing else."""
    source = open_source(url, ssl_context=tls)
    fetched: list[int] = []
    reads = source.read_range

    def counting(start: int, length: int) -> bytes:
        fetched.append(length)
        return reads(start, length)

    source.read_range = counting  # type: ignore[method-assign]
    with open_encrypted(source, dek, kid) as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
        start, end = header[name]["data_offsets"]
        handle.seek(8 + length + start)
        values = struct.unpack(f"<{(end - start) // 4}f", handle.read(end - start))
    return values, sum(fetched), source.size()


async def _broker_verified(client: BrokerClient) -> bool:
    """The runner checks the broker before it sends anything: the broker's token (from the
    development launcher, as Confidential Space's) names the expected image and binds the TLS
    key of this very connection and the broker's other keys."""
    try:
        verified = await client.verify_broker()
    except BrokerClientError as exc:
        _say("broker", f"FAILED: the broker's attestation did not verify: {exc}")
        return False
    _say(
        "broker",
        f"attested through the development launcher as image {verified.image_digest[:19]}…; "
        "the runner verified it and pinned its TLS key (bound keys: "
        f"{', '.join(sorted(verified.keys))})",
    )
    return True


async def _runners(
    client: BrokerClient, issuer: DevIssuer, storage: str, tls: ssl.SSLContext, workdir: Path
) -> bool:
    good = DevTokenSource(issuer, Workload(image_digest=ALLOWED_DIGEST), utc_now)
    try:
        released = await client.release(DEMO_KEY, good)
    except BrokerClientError as exc:
        _say("runner", f"FAILED: the allowed runner was refused: {exc} {exc.details}")
        return False
    kid = key_id(released.key, released.version)
    url = f"{storage}/model.safetensors.brkw"
    values, fetched, total = await asyncio.to_thread(
        _read_tensor, url, released.dek, kid, "layer.5.weight", tls
    )
    if set(values) != {5.0}:
        _say("runner", "FAILED: the tensor read with random access is wrong")
        return False
    _say(
        "runner",
        f"allowed image {ALLOWED_DIGEST[:19]}…: released {released.key} v{released.version} "
        f"(decision {released.decision_id})",
    )
    _say(
        "runner",
        f"read tensor layer.5.weight ({len(values)} floats) from {url}: fetched and decrypted "
        f"{fetched} of {total} bytes",
    )
    target = workdir / "runner" / "model.safetensors"
    await asyncio.to_thread(target.parent.mkdir, exist_ok=True)
    size = await decrypt_to(url, target, released.dek, kid, ssl_context=tls)
    manifest = json.loads(await asyncio.to_thread((workdir / "bucket" / "manifest.json").read_text))
    digest = await asyncio.to_thread(lambda: hashlib.sha256(target.read_bytes()).hexdigest())
    if digest != manifest["files"][0]["sha256"]:
        _say("runner", "FAILED: the streamed file differs from the owner's manifest")
        return False
    _say(
        "runner",
        f"streamed the whole file ({size} bytes, parallel segments): SHA-256 matches the manifest",
    )
    bad = DevTokenSource(issuer, Workload(image_digest=OTHER_DIGEST), utc_now)
    try:
        await client.release(DEMO_KEY, bad)
    except BrokerClientError as exc:
        if exc.status == 403 and exc.code == "policy_denied":
            _say("runner", f"other image {OTHER_DIGEST[:19]}…: denied 403 policy_denied")
            for reason in exc.details.get("reasons", []):
                _say("runner", f"  reason: {reason}")
            return True
        _say("runner", f"FAILED: the other image was refused with {exc}, not a policy deny")
        return False
    _say("runner", "FAILED: a runner with a disallowed image received the key")
    return False


async def _attest_once(client: BrokerClient, issuer: DevIssuer) -> Attestation | None:
    """Evidence verified once; the weights key and a query key released on the one result."""
    good = DevTokenSource(issuer, Workload(image_digest=ALLOWED_DIGEST), utc_now)
    try:
        attestation = await client.attest(good)
        released = await attestation.release_many([DEMO_KEY, DEMO_QUERY_KEY])
    except BrokerClientError as exc:
        _say("attest", f"FAILED: {exc} {exc.details}")
        return None
    _say(
        "attest",
        f"attested once: EAR {attestation.jti} (until {attestation.expires_at:%H:%M:%S}Z), "
        "bound to a PoP key and an encryption key made in the runner",
    )
    for name, result in released.items():
        if isinstance(result, BrokerClientError):
            _say("attest", f"FAILED: {name} refused on the attestation: {result}")
            return None
        _say(
            "attest",
            f"released {name} v{result.version} ({result.algorithm}) on it with a DPoP proof; "
            "no evidence sent again",
        )
    return attestation


async def _revoked(attestation: Attestation) -> bool:
    """After the reload: the attestation was revoked, and says why."""
    try:
        await attestation.release(DEMO_KEY)
    except BrokerClientError as exc:
        if exc.code == "attestation_revoked":
            _say(
                "attest",
                f"the next release on EAR {attestation.jti[:8]}… is refused: 401 "
                f"attestation_revoked",
            )
            _say("attest", f"  reason: {exc.details.get('reason')}")
            return True
        _say("attest", f"FAILED: refused with {exc}, not a revocation")
        return False
    _say("attest", "FAILED: the revoked attestation still released a key")
    return False


def _p256_pem(path: Path) -> None:
    write_private_pem(path, ec.generate_private_key(ec.SECP256R1()))


WITHDRAWN = f"""package broker.key_policies.demo_withdrawn

import rego.v1

applies_to := {{"{DEMO_KEY}"}}

deny contains "image {ALLOWED_DIGEST[:19]}… was withdrawn by the security team" if {{
\tinput.tee.workload.image_digest == "{ALLOWED_DIGEST}"
}}
"""


async def _policy_reload(
    client: BrokerClient,
    issuer: DevIssuer,
    *,
    workdir: Path,
    base: str,
    admin_token: str,
    tls: ssl.SSLContext,
) -> bool:
    """The security team withdraws the allowed image with a per-key policy and takes it off
    the allow-list, and reloads."""
    module = workdir / "policies" / "broker" / "key_policies" / "demo_withdrawn.rego"
    await asyncio.to_thread(module.parent.mkdir, parents=True, exist_ok=True)
    await asyncio.to_thread(module.write_text, WITHDRAWN, encoding="utf-8")
    await asyncio.to_thread(allow_images, workdir, {DEMO_KEY: [], DEMO_QUERY_KEY: []})
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{base}/v1/admin/policy/reload",
            headers={"Authorization": f"Bearer {admin_token}"},
            ssl=tls,
        ) as response,
    ):
        body = await response.json()
    if response.status != 200 or not body.get("changed"):
        _say("policy", f"FAILED: the reload did not take effect: {response.status} {body}")
        return False
    _say(
        "policy",
        f"security team withdrew the image and reloaded: {body['previous_digest'][:19]}… -> "
        f"{body['active_digest'][:19]}…",
    )
    good = DevTokenSource(issuer, Workload(image_digest=ALLOWED_DIGEST), utc_now)
    try:
        await client.release(DEMO_KEY, good)
    except BrokerClientError as exc:
        if exc.code == "policy_denied":
            _say("runner", f"the formerly allowed image is now denied: {exc.details['reasons']}")
            return True
        _say("runner", f"FAILED: refused with {exc}, not a policy deny")
        return False
    _say("runner", "FAILED: the withdrawn image still received the key")
    return False


async def _prove_through_api(
    settings: Settings, base: str, token: str, tls: ssl.SSLContext
) -> bool:
    """An auditor's view: the signed checkpoint, and one decision proven included in it."""
    signer = await open_checkpoint_signer(settings)
    assert signer is not None  # noqa: S101 - the dev workspace always sets a signing key
    verifier = NoteVerifier.parse(signer.verifier_key())
    headers = {"Authorization": f"Bearer {token}"}
    async with aiohttp.ClientSession(headers=headers) as session:
        checkpoint = None
        for _ in range(50):  # checkpoints follow new records within checkpoint_seconds
            async with session.get(f"{base}/v1/log/checkpoint", ssl=tls) as reply:
                note = await reply.text()
            checkpoint = parse_checkpoint(verifier.open(note), origin=verifier.name)
            if checkpoint.size >= 12:
                break
            await asyncio.sleep(0.1)
        assert checkpoint is not None  # noqa: S101 - the loop ran
        async with session.get(
            f"{base}/v1/log/entries?start=0&end={checkpoint.size}", ssl=tls
        ) as reply:
            lines = (await reply.read()).splitlines()
        # the allowed release (after the keys' creation, encryption, policy_change)
        index = next(i for i, line in enumerate(lines) if b'"type":"release"' in line)
        record = lines[index]
        url = f"{base}/v1/log/proof/inclusion?index={index}&tree_size={checkpoint.size}"
        async with session.get(url, ssl=tls) as reply:
            proof = [base64.b64decode(h) for h in (await reply.json())["hashes"]]
    _say("audit", f"verifier key (auditors pin it): {signer.verifier_key()}")
    for line in note.rstrip("\n").splitlines():
        _say("audit", f"  {line}")
    if not verify_inclusion(leaf_hash(record), index, checkpoint.size, proof, checkpoint.root):
        _say("audit", "FAILED: the inclusion proof does not verify")
        return False
    _say(
        "audit",
        f"record {index} ({json.loads(record)['result']}) proven included in the signed "
        f"checkpoint of {checkpoint.size} records ({len(proof)} hashes, through the API)",
    )
    return True


def _reopen_workspace(workdir: Path, auditor_token: str) -> None:
    """Undo the demo's withdrawal (its module, the emptied allow-list) so the workspace releases
    again once served, and say how: its issuer mints tokens as a ``broker dev init`` one's; and
    where its auditor console is, with the token to log in (docs/console.md)."""
    (workdir / "policies" / "broker" / "key_policies" / "demo_withdrawn.rego").unlink()
    allow_images(workdir, {DEMO_KEY: [ALLOWED_DIGEST], DEMO_QUERY_KEY: [ALLOWED_DIGEST]})
    for line in (
        f"{workdir} is a development workspace ({DEMO_KEY} allowed again for the image):",
        f"  BROKER_SERVER_LISTEN=127.0.0.1:8443 broker serve --config {workdir}/broker.toml",
        f"  broker dev token {workdir} --image {ALLOWED_DIGEST} --nonce <nonce>",
        f"  DevTokenSource.from_workspace(Path({str(workdir)!r}), image={ALLOWED_DIGEST!r})",
    ):
        _say("next", line)
    _say("console", f"served as above: https://127.0.0.1:8443/console/ (TLS: {workdir}/tls/ca.pem)")
    _say("console", f"log in with the auditor token {auditor_token}")


def _label(record: dict[str, Any]) -> str:
    kind = str(record.get("type"))
    if kind in ("attestation", "attested_release", "identity") or kind.startswith("kbs_"):
        return f"{kind} {record.get('result')}"
    if kind == "key_admin":  # a change: its intent, then its outcome ("create ok")
        return " ".join(str(part) for part in (record.get("action"), record.get("result")) if part)
    return str(record.get("result") or record.get("action") or kind)


def _audit(log_path: Path) -> bool:
    report = verify_file(log_path)
    lines = log_path.read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines]
    results = [_label(record) for record in records]
    # the policy that went live at start-up, and the workload-certificate CA, are logged before
    # the first decision
    expected = [
        "create", "create ok", "create", "create ok", "weights-encrypt", "policy_change",
        "identity_ca", "allow", "deny",
        "attestation allow", "attested_release allow", "attestation allow", "identity allow",
        "attestation allow", "identity allow", "kbs_auth allow", "kbs_attest allow",
        "kbs_resource allow", "policy_change", "attestation_revoked",
        "attestation_revoked", "attestation_revoked", "deny", "attested_release deny",
    ]  # fmt: skip
    if results != expected:
        _say("audit", f"FAILED: expected {', '.join(expected)}; found {results}")
        return False
    _say(
        "audit",
        f"decision log verified: {report.head.size} records ({', '.join(results)}), "
        f"head {report.head.hash[:16]}…",
    )
    return True

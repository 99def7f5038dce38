"""``broker demo``: the whole product on loopback, on embedded defaults.

1. Make a work directory: dev TLS material, a development issuer's JWKS, a policy directory
   (the shipped Rego plus data allowing one image digest for the demo key) and ``broker.toml``.
2. Load that config through the normal validation, create the key (local development KEK).
3. Encrypt a sample "weights" file with the DEK, as the model owner would.
4. Start the broker over TLS on 127.0.0.1 (a free port).
5. A sealed runner with the allowed image gets the key through ``broker.client`` and decrypts
   the sample; a runner with another image is denied with the policy's reasons.
6. The security team withdraws the allowed image with a per-key policy and reloads it through
   the admin API (checked, tested, swapped); the same runner is now denied with the new reason.
7. An auditor fetches the signed checkpoint and proves the allowed decision is included in it,
   through the audit API.
8. Verify the decision log: creation, allow, deny, the policy change, deny; chain intact.

Returns True only if every step happened as expected.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
import secrets
import ssl
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
from aiohttp import web

from broker.api.server import BrokerRunner
from broker.app import create_app, server_ssl_context
from broker.audit.checkpoint import NoteVerifier, parse_checkpoint
from broker.audit.log import DecisionLog, verify_file
from broker.audit.merkle import leaf_hash, verify_inclusion
from broker.audit.signers import open_checkpoint_signer
from broker.client import BrokerClient, BrokerClientError
from broker.config import Settings, load_settings
from broker.crypto.weights import decrypt_stream, encrypt_stream
from broker.dev.issuer import DevIssuer, DevTokenSource, Workload
from broker.dev.workspace import write_dev_workspace
from broker.keys.factory import open_key_service
from broker.keys.store.base import Purpose
from broker.keys.wrap import key_id

DEMO_KEY = "models/demo-llama"
AUDIENCE = "https://broker.demo.invalid"
ALLOWED_DIGEST = "sha256:" + hashlib.sha256(b"sealed-runner:1.0").hexdigest()
OTHER_DIGEST = "sha256:" + hashlib.sha256(b"tampered-runner:6.6").hexdigest()
SAMPLE = b"layer.0.weight " + bytes(range(256)) * 4096  # ~1 MiB of pretend weights


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def utc_now() -> datetime:
    return datetime.now(UTC)


def _say(step: str, text: str) -> None:
    print(f"[{step}] {text}", flush=True)


async def run_demo(workdir: Path | None) -> bool:
    """Run every step; print a few lines; True only if all happened as expected."""
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="broker-demo-") as tmp:
            return await _run(Path(tmp))
    workdir.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - once, before serving
    return await _run(workdir)


async def _run(workdir: Path) -> bool:
    issuer = DevIssuer(dev_mode=True)
    admin_token = secrets.token_urlsafe(24)  # the security team's, for the reload step
    config = write_dev_workspace(
        workdir,
        issuer,
        audience=AUDIENCE,
        images={DEMO_KEY: [ALLOWED_DIGEST]},
        now=utc_now(),
        extra_toml=f'[admin]\ntoken_sha256 = ["{_sha256(admin_token)}"]\n',
    )
    settings = load_settings(config, environ={})
    _say("setup", f"config {config} (TLS on loopback, development issuer {issuer.issuer})")

    async with open_key_service(settings.keys, create_missing_kek=True) as keys:
        change_log = DecisionLog(settings.audit.log, replica=settings.server.replica_id)
        await change_log.open()
        keys.attach_change_log(change_log.append)
        record = await keys.create(DEMO_KEY, Purpose.MODEL_WEIGHTS, now=utc_now())
        await change_log.close()
        sealed = io.BytesIO()
        encrypt_stream(await keys.unwrap(record), key_id(DEMO_KEY, 1), io.BytesIO(SAMPLE), sealed)
    _say("owner", f"created {DEMO_KEY} v1; encrypted {len(SAMPLE)} bytes of weights with it")

    runner = BrokerRunner(create_app(settings), settings.server)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_ssl_context(settings))
    await site.start()
    port = runner.addresses[0][1]
    client_tls = ssl.create_default_context(cafile=str(workdir / "tls" / "ca.pem"))
    ok = False
    try:
        async with BrokerClient(f"https://127.0.0.1:{port}", ssl_context=client_tls) as client:
            ok = await _runners(client, issuer, sealed.getvalue())
            base = f"https://127.0.0.1:{port}"
            ok = ok and await _policy_reload(
                client, issuer, workdir=workdir, base=base, admin_token=admin_token, tls=client_tls
            )
            ok = ok and await _prove_through_api(settings, base, admin_token, client_tls)
    finally:
        await runner.cleanup()
    return ok and _audit(settings.audit.log)


async def _runners(client: BrokerClient, issuer: DevIssuer, sealed: bytes) -> bool:
    good = DevTokenSource(issuer, Workload(image_digest=ALLOWED_DIGEST), utc_now)
    try:
        released = await client.release(DEMO_KEY, good)
    except BrokerClientError as exc:
        _say("runner", f"FAILED: the allowed runner was refused: {exc} {exc.details}")
        return False
    plain = io.BytesIO()
    decrypt_stream(released.dek, key_id(released.key, released.version), io.BytesIO(sealed), plain)
    if plain.getvalue() != SAMPLE:
        _say("runner", "FAILED: decrypted weights differ from the original")
        return False
    _say(
        "runner",
        f"allowed image {ALLOWED_DIGEST[:19]}…: released {released.key} v{released.version} "
        f"(decision {released.decision_id}); decrypted the weights, bytes match",
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
    """The security team withdraws the allowed image with a per-key policy and reloads."""
    module = workdir / "policies" / "broker" / "key_policies" / "demo_withdrawn.rego"
    await asyncio.to_thread(module.parent.mkdir, parents=True, exist_ok=True)
    await asyncio.to_thread(module.write_text, WITHDRAWN, encoding="utf-8")
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
            if checkpoint.size >= 5:
                break
            await asyncio.sleep(0.1)
        assert checkpoint is not None  # noqa: S101 - the loop ran
        index = 1  # the allowed release
        async with session.get(
            f"{base}/v1/log/entries?start={index}&end={index + 1}", ssl=tls
        ) as reply:
            record = (await reply.read()).split(b"\n")[0]
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


def _audit(log_path: Path) -> bool:
    report = verify_file(log_path)
    lines = log_path.read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines]
    results = [record.get("result") or record.get("action") for record in records]
    results = [r or record.get("type") for r, record in zip(results, records, strict=True)]
    expected = ["create", "allow", "deny", "policy_change", "deny"]
    if results != expected:
        _say("audit", f"FAILED: expected {', '.join(expected)}; found {results}")
        return False
    _say(
        "audit",
        f"decision log verified: {report.head.size} records ({', '.join(results)}), "
        f"head {report.head.hash[:16]}…",
    )
    return True

"""``broker demo``: the whole product on loopback, on embedded defaults.

1. Make a work directory: dev TLS material, a development issuer's JWKS, a policy directory
   (the shipped Rego plus data allowing one image digest for the demo key) and ``broker.toml``.
2. Load that config through the normal validation, create the key (local development KEK).
3. Encrypt a sample "weights" file with the DEK, as the model owner would.
4. Start the broker over TLS on 127.0.0.1 (a free port).
5. A sealed runner with the allowed image gets the key through ``broker.client`` and decrypts
   the sample; a runner with another image is denied with the policy's reasons.
6. Verify the decision log: the key's creation and both decisions, chain intact.

Returns True only if every step happened as expected.
"""

from __future__ import annotations

import hashlib
import io
import json
import ssl
import tempfile
from datetime import UTC, datetime
from pathlib import Path

from aiohttp import web

from broker.api.server import BrokerRunner
from broker.app import create_app, server_ssl_context
from broker.audit.log import DecisionLog, verify_file
from broker.client import BrokerClient, BrokerClientError
from broker.config import load_settings
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
    config = write_dev_workspace(
        workdir, issuer, audience=AUDIENCE, images={DEMO_KEY: [ALLOWED_DIGEST]}, now=utc_now()
    )
    settings = load_settings(config, environ={})
    _say("setup", f"config {config} (TLS on loopback, development issuer {issuer.issuer})")

    async with open_key_service(settings.keys, create_missing_kek=True) as keys:
        change_log = DecisionLog(settings.audit.log)
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


def _audit(log_path: Path) -> bool:
    report = verify_file(log_path)
    lines = log_path.read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines]
    results = [record.get("result") or record.get("action") for record in records]
    if results != ["create", "allow", "deny"]:
        _say("audit", f"FAILED: expected create, allow, deny; found {results}")
        return False
    _say(
        "audit",
        f"decision log verified: {report.head.size} records ({', '.join(results)}), "
        f"head {report.head.hash[:16]}…",
    )
    return True

"""Witnessing: checkpoints offered to a tlog-witness on loopback, which checks the log's
signature and the consistency proof from what it last saw before cosigning (cosignature/v1);
``broker audit verify --witness-key`` requires the cosignature."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric import ed25519

from broker.audit.publisher import checkpoint_paths
from broker.audit.witness import WitnessKey, cosignature_line, witness_verifier_key
from broker.crypto.checkpoint import NoteSigner, NoteVerifier, parse_checkpoint
from broker.crypto.merkle import verify_consistency
from tests.integration.conftest import RunningBroker
from tests.support.cli import run
from tests.support.constants import KEY

ROOT = Path(__file__).resolve().parents[2]
AUDITOR = "witness-test-auditor-token"


class LoopbackWitness:
    """A witness per C2SP tlog-witness: refuses anything that does not extend what it saw."""

    def __init__(self, name: str = "witness.test.invalid") -> None:
        self.name = name
        self.key = ed25519.Ed25519PrivateKey.generate()
        self.log_verifier: NoteVerifier | None = None
        self.size = 0
        self.root = b""
        self.cosigned: list[int] = []

    @property
    def verifier_key(self) -> str:
        return witness_verifier_key(self.name, self.key.public_key().public_bytes_raw())

    async def add_checkpoint(self, request: web.Request) -> web.Response:
        assert self.log_verifier is not None
        text = (await request.read()).decode()
        head, _, note = text.partition("\n\n")
        lines = head.split("\n")
        old = int(lines[0].removeprefix("old "))
        proof = [base64.b64decode(line) for line in lines[1:] if line]
        try:
            body = self.log_verifier.open(note)
        except ValueError:
            return web.Response(status=403, text="bad log signature")
        checkpoint = parse_checkpoint(body)
        if old != self.size:
            return web.Response(status=409, text=str(self.size), content_type="text/x.tlog.size")
        if self.size and not verify_consistency(
            self.size, checkpoint.size, self.root, checkpoint.root, proof
        ):
            return web.Response(status=422, text="not consistent")
        self.size, self.root = checkpoint.size, checkpoint.root
        self.cosigned.append(checkpoint.size)
        return web.Response(text=cosignature_line(self.name, self.key, body, int(time.time())))


async def test_checkpoints_are_cosigned_and_verify_requires_it(start_broker: Any) -> None:
    witness = LoopbackWitness()
    app = web.Application()
    app.router.add_post("/add-checkpoint", witness.add_checkpoint)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        broker: RunningBroker = await start_broker(
            environ={
                "BROKER_AUDIT_WITNESSES": url,
                "BROKER_AUDIT_WITNESS_KEYS": witness.verifier_key,
                "BROKER_ADMIN_TOKEN_SHA256": hashlib.sha256(AUDITOR.encode()).hexdigest(),
            }
        )
        signer = await asyncio.to_thread(
            NoteSigner.from_pem, broker.settings.audit.origin, broker.workdir / "log-ed25519.pem"
        )
        witness.log_verifier = NoteVerifier.parse(signer.verifier_key())
        for round_ in range(2):  # the second round is cosigned over a consistency proof
            async with broker.client() as client:
                for _ in range(3):
                    await client.release(KEY, broker.token_source())
            for _ in range(300):
                if witness.cosigned and witness.cosigned[-1] >= 3 * (round_ + 1):
                    break
                await asyncio.sleep(0.05)
            assert witness.cosigned[-1] >= 3 * (round_ + 1)
        async with (
            aiohttp.ClientSession() as session,
            session.get(
                broker.url + "/v1/log/checkpoint",
                headers={"Authorization": f"Bearer {AUDITOR}"},
                ssl=broker.client_tls,
            ) as reply,
        ):
            note = await reply.text()
        body = note[: note.rfind("\n\n") + 1]
        assert WitnessKey.parse(witness.verifier_key).cosigned(note, body)
        note_file = broker.workdir / "witnessed.checkpoint"
        await asyncio.to_thread(note_file.write_text, note)
        log = broker.settings.audit.log

        def audit(*keys: str) -> tuple[int, dict[str, object]]:
            args = ["audit", "verify", str(log),
                    "--checkpoint", str(note_file), "--key", signer.verifier_key()]  # fmt: skip
            for key in keys:
                args += ["--witness-key", key]
            done = run(*args)
            return done.returncode, json.loads(done.stdout)

        code, report = await asyncio.to_thread(audit, witness.verifier_key)
        assert (code, report["witnesses"]) == (0, [witness.name])
        stranger = LoopbackWitness("other.witness.invalid")
        code, report = await asyncio.to_thread(audit, stranger.verifier_key)
        assert code == 1
        assert "not cosigned by witness other.witness.invalid" in str(report["problem"])
    finally:
        await runner.cleanup()


async def test_an_absent_witness_leaves_the_log_signature(start_broker: Any) -> None:
    witness = LoopbackWitness()
    broker: RunningBroker = await start_broker(
        environ={
            "BROKER_AUDIT_WITNESSES": "http://127.0.0.1:9",
            "BROKER_AUDIT_WITNESS_KEYS": witness.verifier_key,
        }
    )
    async with broker.client() as client:
        await client.release(KEY, broker.token_source())
    latest = checkpoint_paths(broker.settings.audit.log)[0]
    for _ in range(300):
        text = await asyncio.to_thread(latest.read_text)
        if parse_checkpoint(text[: text.rfind("\n\n") + 1]).size >= 1:
            break
        await asyncio.sleep(0.05)
    assert text.count("\u2014 ") == 1  # only the log's own signature

"""A C2SP tlog-witness on loopback that keeps one history per log origin, as real witnesses do:
it cosigns a checkpoint only if its log's key signed it and it extends (consistency proof) what
the witness last cosigned for that origin; anything else is counted as a refusal (a fork, from
the witness's point of view)."""

from __future__ import annotations

import base64
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from aiohttp import web
from cryptography.hazmat.primitives.asymmetric import ed25519

from broker.audit.witness import cosignature_line, witness_verifier_key
from broker.crypto.checkpoint import NoteError, NoteVerifier, parse_checkpoint
from broker.crypto.merkle import verify_consistency


@dataclass
class OriginWitness:
    log_keys: dict[str, str]  # origin -> the log's note verifier key
    name: str = "witness.test.invalid"
    key: ed25519.Ed25519PrivateKey = field(default_factory=ed25519.Ed25519PrivateKey.generate)
    seen: dict[str, tuple[int, bytes]] = field(default_factory=dict)
    refused: list[str] = field(default_factory=list)

    @property
    def verifier_key(self) -> str:
        return witness_verifier_key(self.name, self.key.public_key().public_bytes_raw())

    async def add_checkpoint(self, request: web.Request) -> web.Response:
        text = (await request.read()).decode()
        head, _, note = text.partition("\n\n")
        lines = head.split("\n")
        old = int(lines[0].removeprefix("old "))
        proof = [base64.b64decode(line) for line in lines[1:] if line]
        origin = note.split("\n", 1)[0]
        if origin not in self.log_keys:
            self.refused.append(f"unknown origin {origin}")
            return web.Response(status=404, text="unknown log")
        try:
            body = NoteVerifier.parse(self.log_keys[origin]).open(note)
        except NoteError:
            self.refused.append(f"{origin}: bad signature")
            return web.Response(status=403, text="bad log signature")
        checkpoint = parse_checkpoint(body)
        size, root = self.seen.get(origin, (0, b""))
        if old != size:
            return web.Response(status=409, text=str(size), content_type="text/x.tlog.size")
        if checkpoint.size < size or (
            size and not verify_consistency(size, checkpoint.size, root, checkpoint.root, proof)
        ):
            self.refused.append(f"{origin}: {checkpoint.size} does not extend {size}")
            return web.Response(status=422, text="not consistent")
        self.seen[origin] = (checkpoint.size, checkpoint.root)
        return web.Response(text=cosignature_line(self.name, self.key, body, int(time.time())))


@asynccontextmanager
async def serve_witness(witness: OriginWitness, port: int) -> AsyncIterator[str]:
    """The witness on ``http://127.0.0.1:<port>`` until the block ends; yields its URL."""
    app = web.Application()
    app.router.add_post("/add-checkpoint", witness.add_checkpoint)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()

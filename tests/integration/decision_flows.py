"""What the tests of the decision kernel share (issue 30): a broker whose every input is fixed,
the three decision paths driven by hand over HTTP, and the faults the tests inject.

``fixed_broker`` serves ``[attest]`` too (all three plans on one broker) with a fixed clock, a
fixed development issuer (key and ``kid``), fixed challenge, mask and result keys, a mask in
``[audit] mask``, and challenges whose random bytes come from a seed: the same scenario writes
the same record, byte for byte, apart from the UUIDs and chain fields a test normalises. Its
handlers are cancelled when their client hangs up (aiohttp's ``handler_cancellation``), so a
test can cut a request in half. The faults replace one method of a real component (the policy
engine, the key store, the KEK, the attestation store, the log writer); nothing else is a
stand-in.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import hashlib
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from broker.audit.log import DecisionLog
from broker.core.binding import attestation_thumbprint
from broker.core.errors import ErrorCode, UpstreamError
from broker.crypto.jwk import public_jwk, thumbprint
from broker.dev.issuer import DevIssuer
from broker.dev.workspace import write_private_pem
from broker.keys.factory import open_key_service
from broker.keys.kek.local import LocalKek
from broker.keys.store.base import Purpose
from broker.keys.store.sqlite import SqliteKeyStore
from broker.policy.engine import Decision
from broker.policy.wasm import WasmPolicyEngine
from broker.stores import nonces as nonces_module
from broker.stores.attestations import MemoryAttestations
from broker.stores.nonces import store_unavailable
from tests.integration.attested import DENIED_KEY, Runner
from tests.integration.conftest import RunningBroker
from tests.support.constants import ALLOWED, KEY
from tests.vectors.tokens import key as vector_key

FIXED = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
ATTEST_TOML = '[attest]\nenabled = true\nsigning_key = "ear-signing.pem"\n'
MASK = "/tee/platform/instance_id"  # [audit] mask: one masked input field in every record
MASK_KEY = b"m" * 32
CHALLENGE_KEY = b"c" * 32
ISSUER = DevIssuer(dev_mode=True, key=vector_key())
ISSUER.kid = "decision-records-issuer"
RUNNER = ec.derive_private_key(0xC0FFEE, ec.SECP256R1())  # full-evidence releases
POP = ec.derive_private_key(0xB0B, ec.SECP256R1())  # an attestation's proof-of-possession key
ENCRYPTION = ec.derive_private_key(0xE7C, ec.SECP256R1())  # an attestation's encryption key
RESULT_SIGNER = ec.derive_private_key(0x5161, ec.SECP256R1())  # the broker's EAR key
PLANS = ("release", "attestation", "attested_release")  # the record types, one per plan


class SeededSecrets:
    """``secrets`` as ``broker.stores.nonces`` sees it: the challenges' random bytes from a seed."""

    def __init__(self, seed: str) -> None:
        self._seed = seed
        self._drawn = 0

    def token_bytes(self, count: int) -> bytes:
        self._drawn += 1
        return hashlib.sha256(f"{self._seed}/{self._drawn}".encode()).digest()[:count]


def _fix_inputs(workdir: Path) -> None:
    """The workspace's random parts made fixed: issuer, secrets, the result key; one mask."""
    ISSUER.write_jwks(workdir / "jwks.json")
    for name, secret in (("challenge.key", CHALLENGE_KEY), ("mask.key", MASK_KEY)):
        (workdir / name).write_bytes(secret)
        (workdir / name).chmod(0o600)
    write_private_pem(workdir / "ear-signing.pem", RESULT_SIGNER)
    config = workdir / "broker.toml"
    text = config.read_text(encoding="utf-8")
    config.write_text(text.replace("[audit]\n", f'[audit]\nmask = ["{MASK}"]\n', 1))


async def fixed_broker(
    start_broker: Callable[..., Awaitable[RunningBroker]],
    monkeypatch: pytest.MonkeyPatch,
    seed: str,
) -> RunningBroker:
    """A broker (this process) with every input fixed, ``[attest]`` on, ``DENIED_KEY`` made."""
    monkeypatch.setattr(nonces_module, "secrets", SeededSecrets(seed))
    broker = await start_broker(
        environ={"BROKER_SERVER_REPLICA_ID": "replica-0"},  # by default, the host's name
        extra_toml=ATTEST_TOML,
        workdir_setup=_fix_inputs,
        clock=lambda: FIXED,
        handler_cancellation=True,
    )
    async with open_key_service(broker.settings.keys) as keys:
        await keys.create(DENIED_KEY, Purpose.MODEL_WEIGHTS, now=FIXED)
    return dataclasses.replace(broker, issuer=ISSUER)


def log_lines(broker: RunningBroker) -> list[bytes]:
    """The decision log's lines exactly as stored (without newlines)."""
    return broker.settings.audit.log.read_bytes().splitlines()


# --- the three decision paths, by hand --------------------------------------------------------


async def post(
    session: aiohttp.ClientSession,
    broker: RunningBroker,
    path: str,
    body: Any,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, Any], str]:
    """POST ``body``; the status, the JSON answer (``{}`` when not JSON) and the raw text."""
    async with session.post(
        broker.url + path, json=body, headers=headers, ssl=broker.client_tls
    ) as response:
        text = await response.text()
        is_json = response.content_type == "application/json"
        return response.status, (await response.json()) if is_json else {}, text


async def release_body(
    session: aiohttp.ClientSession,
    broker: RunningBroker,
    *,
    digest: str = ALLOWED,
    **changes: Any,
) -> dict[str, Any]:
    """A full-evidence release of ``KEY`` to ``RUNNER``, with ``changes`` to its fields."""
    _, challenge, _ = await post(session, broker, "/v1/challenge", {})
    jwk = public_jwk(RUNNER.public_key())
    token = await broker.token_source(digest).token(
        challenge["audience"], [challenge["nonce"], thumbprint(jwk)]
    )
    body = {"key": KEY, "nonce": challenge["nonce"], "evidence": {"gca": token}, "runner_key": jwk}
    return {**body, **changes}


async def attest_body(
    session: aiohttp.ClientSession, runner: Runner, *, digest: str = ALLOWED
) -> dict[str, Any]:
    """``POST /v1/attest``'s body for ``runner``'s fixed keys (``fixed_runner``)."""
    broker = runner.broker
    _, challenge, _ = await post(session, broker, "/v1/challenge", {})
    pop_jwk = public_jwk(runner.pop.public_key())
    binding = attestation_thumbprint(thumbprint(runner.encryption_jwk), thumbprint(pop_jwk))
    token = await broker.token_source(digest).token(
        challenge["audience"], [challenge["nonce"], binding]
    )
    return {
        "nonce": challenge["nonce"],
        "evidence": {"gca": token},
        "runner_key": runner.encryption_jwk,
        "pop_key": pop_jwk,
    }


def fixed_runner(broker: RunningBroker) -> Runner:
    """``attested.Runner`` with the fixed PoP and encryption keys."""
    runner = Runner(broker)
    runner.pop = POP
    runner.encryption = ENCRYPTION
    runner.encryption_jwk = public_jwk(ENCRYPTION.public_key())
    return runner


def fixed_proof(runner: Runner, jti: str = "proof-1") -> str:
    """A DPoP proof at the broker's fixed time, with a fixed ``jti``."""
    return runner.proof(iat=int(FIXED.timestamp()), jti=jti)


# --- faults: one method of a real component replaced ----------------------------------------


def policy_bug(monkeypatch: pytest.MonkeyPatch, *, after: int = 0) -> None:
    """The policy engine raises a non-``BrokerError`` (a bug) from its ``after``+1-th call on."""
    original = WasmPolicyEngine.evaluate
    calls = 0

    async def evaluate(
        engine: WasmPolicyEngine, policy_input: Any, *, encoded: bytes | None = None
    ) -> Decision:
        nonlocal calls
        calls += 1
        if calls > after:
            raise RuntimeError("injected bug: secret-ish detail not-hex-Q7f3aZ")
        return await original(engine, policy_input, encoded=encoded)

    monkeypatch.setattr(WasmPolicyEngine, "evaluate", evaluate)


RECORD_BODIES = {  # where each plan builds its part of the record
    "release": "broker.decisions.release.ReleasePlan.body",
    "attestation": "broker.decisions.attest.AttestPlan.body",
    "attested_release": "broker.decisions.attested_release.AttestedReleasePlan.body",
}


def record_bug(monkeypatch: pytest.MonkeyPatch, plan: str) -> None:
    """Building ``plan``'s record raises a non-``BrokerError`` (a bug)."""

    def broken(*_: Any, **__: Any) -> dict[str, Any]:
        raise RuntimeError("injected bug in the record builder")

    monkeypatch.setattr(RECORD_BODIES[plan], broken)


def key_store_down(monkeypatch: pytest.MonkeyPatch) -> None:
    """The SQLite key store fails every read, as its adapter reports a failure."""

    async def down(*_: Any) -> None:
        raise UpstreamError("the key store did not answer", code=ErrorCode.KEY_STORE_UNAVAILABLE)

    monkeypatch.setattr(SqliteKeyStore, "_one", down)


def kek_down(monkeypatch: pytest.MonkeyPatch) -> None:
    """The local KEK cannot unwrap (a KEK service that does not answer)."""

    async def down(*_: Any) -> bytes:
        raise UpstreamError("the KEK did not answer", code=ErrorCode.KEK_UNAVAILABLE)

    monkeypatch.setattr(LocalKek, "unwrap", down)


def attestation_store_down(monkeypatch: pytest.MonkeyPatch) -> None:
    """The attestation store (memory, this process) fails every write."""

    async def down(*_: Any) -> None:
        raise store_unavailable()

    monkeypatch.setattr(MemoryAttestations, "put", down)


def log_down(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decision log's next write fails with ENOSPC in its writer thread (a full disk)."""

    def full(*_: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DecisionLog, "_seal_and_write", full)


class Gate:
    """Holds every policy evaluation at its start until ``opened`` (a slow engine), so that a
    client can hang up while its request is being decided."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered = asyncio.Event()
        self.opened = asyncio.Event()
        original = WasmPolicyEngine.evaluate

        async def held(
            engine: WasmPolicyEngine, policy_input: Any, *, encoded: bytes | None = None
        ) -> Decision:
            self.entered.set()
            await self.opened.wait()
            return await original(engine, policy_input, encoded=encoded)

        monkeypatch.setattr(WasmPolicyEngine, "evaluate", held)


def _handlers() -> set[asyncio.Task[Any]]:
    """The server's connection handlers (aiohttp's ``RequestHandler.start`` tasks)."""
    return {
        task
        for task in asyncio.all_tasks()
        if getattr(task.get_coro(), "__qualname__", "") == "RequestHandler.start"
    }


async def hang_up_while_deciding(
    broker: RunningBroker,
    gate: Gate,
    send: Callable[[aiohttp.ClientSession], Awaitable[object]],
) -> None:
    """Send a request on a connection of its own, hang up once the policy is asked, wait until
    the server has cancelled that connection's handler, then let the decision go on.

    Fails the test if no handler was cancelled (the hang-up would then prove nothing)."""
    before = _handlers()
    async with aiohttp.ClientSession() as session:
        request = asyncio.ensure_future(send(session))
        await asyncio.wait_for(gate.entered.wait(), 20)
        serving = _handlers() - before
        assert serving, "no connection handler is serving the request"
        request.cancel()  # the client hangs up: its connection is closed
        with contextlib.suppress(asyncio.CancelledError):
            await request
    for _ in range(200):
        if all(task.done() for task in serving):
            break
        await asyncio.sleep(0.01)
    assert all(task.done() for task in serving), "the handler was not cancelled"
    gate.opened.set()


async def wait_for_lines(broker: RunningBroker, count: int) -> list[bytes]:
    """The log's lines once it holds at least ``count`` (a decision finishing in background)."""
    for _ in range(500):
        lines = await asyncio.to_thread(log_lines, broker)
        if len(lines) >= count:
            return lines
        await asyncio.sleep(0.01)
    pytest.fail(f"the decision log never reached {count} records")

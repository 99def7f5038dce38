"""Embedded Rego engine (regopy, the default backend).

The policy directory is compiled once per load into a regopy ``Bundle``; each evaluation runs the
compiled plan on a dedicated worker thread with its own interpreter, bounded by
``eval_timeout``. A timeout or an evaluation error is an ``UpstreamError`` (503,
``policy_unavailable``): the request fails closed and nothing is released.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from regopy import Bundle, Input, Interpreter, RegoError

from broker.errors import ConfigError, ErrorCode, UpstreamError
from broker.policy.bundle import PolicyBundle
from broker.policy.engine import RULE_PATH, Decision

log = logging.getLogger(__name__)
QUERY = f"result = {RULE_PATH}"


class PolicyCompileError(ConfigError):
    def __init__(self, problem: str) -> None:
        super().__init__("policy.dir", problem)


def new_interpreter(bundle: PolicyBundle, *, with_tests: bool = False) -> Interpreter:
    """An interpreter loaded with the bundle's modules and data.

    Raises:
        PolicyCompileError: when a module does not parse.
    """
    interpreter = Interpreter()
    modules = {**bundle.modules, **(bundle.test_modules if with_tests else {})}
    try:
        for name, text in sorted(modules.items()):
            interpreter.add_module(name, text)
        interpreter.add_data(dict(bundle.data))
    except RegoError as exc:
        raise PolicyCompileError(f"Rego does not compile: {exc}") from exc
    return interpreter


def compile_bundle(bundle: PolicyBundle) -> Bundle:
    """Compile the release query once.

    Raises:
        PolicyCompileError: when the modules do not compile or define no ``allow`` rule.
    """
    if not any(
        "package broker.release\n" in text or text.startswith("package broker.release")
        for text in bundle.modules.values()
    ):
        raise PolicyCompileError("no module declares package broker.release")
    try:
        compiled = new_interpreter(bundle).build(QUERY, [])
    except RegoError as exc:
        raise PolicyCompileError(f"Rego does not compile: {exc}") from exc
    if not compiled.ok():
        raise PolicyCompileError("Rego bundle did not build")
    return compiled


class EmbeddedPolicyEngine:
    """``PolicyEngine`` backed by regopy."""

    def __init__(self, bundle: PolicyBundle, *, eval_timeout_seconds: float) -> None:
        self._bundle = bundle
        self._compiled = compile_bundle(bundle)
        self._timeout = eval_timeout_seconds
        self._local = threading.local()
        # One worker: regopy interpreters are not shared between threads, and a runaway
        # evaluation must not take more than one thread with it.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rego")

    @property
    def digest(self) -> str:
        return self._bundle.digest

    async def evaluate(self, policy_input: Mapping[str, Any]) -> Decision:
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._executor, self._evaluate_sync, dict(policy_input))
        try:
            result = await asyncio.wait_for(future, self._timeout)
        except TimeoutError as exc:
            raise UpstreamError(
                "policy evaluation timed out", code=ErrorCode.POLICY_UNAVAILABLE
            ) from exc
        return Decision.from_result(result, self._bundle.digest)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _evaluate_sync(self, policy_input: dict[str, Any]) -> Any:
        interpreter = getattr(self._local, "interpreter", None)
        if interpreter is None:
            interpreter = self._local.interpreter = Interpreter()
        try:
            interpreter.set_input(Input(policy_input))
            output = interpreter.query_bundle(self._compiled)
        # ValueError: regopy renders some results as invalid JSON (e.g. sprintf of a literal
        # string default); an answer we cannot read is no answer.
        except (RegoError, ValueError) as exc:
            log.exception("policy evaluation failed")
            raise UpstreamError(
                "policy evaluation failed", code=ErrorCode.POLICY_UNAVAILABLE
            ) from exc
        if not output.ok():
            log.error("policy evaluation error: %s", output)
            raise UpstreamError("policy evaluation failed", code=ErrorCode.POLICY_UNAVAILABLE)
        if str(output) == "undefined":
            return None
        try:
            return json.loads(output.binding("result").json())
        except ValueError as exc:
            log.exception("policy result is not valid JSON")
            raise UpstreamError(
                "policy evaluation failed", code=ErrorCode.POLICY_UNAVAILABLE
            ) from exc

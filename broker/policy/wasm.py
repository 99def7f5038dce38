"""The embedded engine: the policy compiled by the pinned ``opa`` to WebAssembly, evaluated in
process with ``wasmtime`` on the event-loop thread (no executor hop: one evaluation of the
shipped policy costs well under the hop itself; ``bench/policy_bench.py``).

Host side of OPA's Wasm ABI (1.2+, https://www.openpolicyagent.org/docs/wasm):

* imports ``env.memory`` (bounded to ``MAX_MEMORY_PAGES``), ``env.opa_abort`` (a runtime error:
  the evaluation fails, 503) and ``env.opa_builtin0..4`` (builtins left to the host, dispatched
  by the ids of the ``builtins`` export);
* data is parsed into the module once (``opa_json_parse``); the heap pointer after it is the
  base every evaluation restarts from;
* one evaluation: the input JSON is written at the base, ``opa_eval(0, entrypoint, data, input,
  len, heap, 0)`` returns the address of ``[{"result": …}]`` (``[]``: undefined).

Evaluation is bounded by wasmtime *fuel* (``EVAL_FUEL`` instructions), not wall time: the event
loop is never blocked for longer than that budget, and no thread is needed to interrupt it.

Builtins left to the host: ``sprintf`` (``sprintf.py``: the subset of verbs OPA and the
broker render alike; others are refused when a policy is built) and ``json.patch``
(``hostbuiltins``; Rego unit tests use it). A policy that needs any other one does not load:
the error names it and points to the OPA server engine (``[policy] engine = "opa"``).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import wasmtime
from wasmtime import _bindings as wasm_ffi  # the raw call below; wasmtime is pinned to a major
from wasmtime._func import enter_wasm

from broker.core.errors import ConfigError, ErrorCode, UpstreamError
from broker.policy.engine import Decision
from broker.policy.hostbuiltins import json_patch
from broker.policy.rego_values import parse_rego_value
from broker.policy.sprintf import Unsupported, sprintf

log = logging.getLogger(__name__)
ENTRYPOINT = "broker_internal/decision/result"
PAGE = 65536
INITIAL_PAGES = 5
MAX_MEMORY_PAGES = 2048  # 128 MiB
EVAL_FUEL = 200_000_000  # instructions per evaluation; the shipped policy needs ~1e6
MAX_RESULT_BYTES = 4 * 1024 * 1024
MIN_ABI = (1, 2)


class PolicyLoadError(ConfigError):
    """The policy cannot be loaded into the Wasm engine (names the reason)."""

    def __init__(self, problem: str) -> None:
        super().__init__("policy", problem)


@dataclass(frozen=True)
class CompiledPolicy:
    """A policy as the Wasm engine runs it: module bytes, data, and the digest that names it."""

    wasm: bytes
    data: Mapping[str, Any]
    digest: str  # opa_bundle.files_digest of ``files``: what decided
    source: str  # the directory or bundle it came from, for messages
    files: Mapping[str, bytes] = field(default_factory=dict)  # the bundle's verified files
    revision: str = ""  # the bundle manifest's revision (``broker policy build --revision``)
    source_digest: str | None = None  # digest of the policy directory it was built from
    claims: Mapping[str, Any] = field(default_factory=dict)  # a signed bundle's verified payload


def _host_sprintf(args: list[Any]) -> Any:
    template, values = args
    if not isinstance(template, str) or not isinstance(values, list):
        raise _BuiltinUndefined
    try:
        return sprintf(template, values)
    except Unsupported as exc:  # a bundle built without our check: fail closed, say why
        log.error("policy evaluation stopped: %s", exc)  # noqa: TRY400 - no traceback to show
        raise _BuiltinUndefined from exc


HOST_BUILTINS: dict[str, Callable[[list[Any]], Any]] = {
    "sprintf": _host_sprintf,
    "json.patch": json_patch,
}


class _BuiltinUndefined(Exception):
    """A host builtin with operands of the wrong type: OPA makes the expression undefined...
    (in Wasm, the host must return a value; we abort the evaluation instead: fail closed)."""


class _Abort(Exception):
    pass


def _new_engine() -> wasmtime.Engine:
    config = wasmtime.Config()
    config.consume_fuel = True
    return wasmtime.Engine(config)


# One engine per process; compiled modules cached by their bytes' digest (compiling the
# shipped policy's module takes ~0.1 s; a reload of unchanged Rego reuses it). Stores, and
# so instances, memories and fuel, stay per policy instance.
_ENGINE = _new_engine()
_MODULES: dict[str, wasmtime.Module] = {}
_MODULES_LOCK = threading.Lock()
MAX_CACHED_MODULES = 16


def _module(compiled: CompiledPolicy) -> wasmtime.Module:
    key = hashlib.sha256(compiled.wasm).hexdigest()
    with _MODULES_LOCK:
        cached = _MODULES.get(key)
    if cached is not None:
        return cached
    try:
        module = wasmtime.Module(_ENGINE, compiled.wasm)
    except wasmtime.WasmtimeError as exc:
        raise PolicyLoadError(f"{compiled.source}: policy.wasm does not load: {exc}") from exc
    with _MODULES_LOCK:
        if len(_MODULES) >= MAX_CACHED_MODULES:
            _MODULES.pop(next(iter(_MODULES)))
        _MODULES[key] = module
    return module


class EvaluationFailed(UpstreamError):
    """The policy stopped with a runtime error (``policy_unavailable``, 503): ``problem`` is
    OPA's message (rule and location) for the log or an auditor, never for a runner."""

    def __init__(self, problem: str) -> None:
        super().__init__("policy evaluation failed", code=ErrorCode.POLICY_UNAVAILABLE)
        self.problem = problem


class WasmPolicyInstance:
    """One instantiated module with its data loaded. Not thread-safe; used on the loop thread."""

    def __init__(
        self,
        compiled: CompiledPolicy,
        *,
        fuel: int = EVAL_FUEL,
        entrypoint: str = ENTRYPOINT,
        failures: int = logging.ERROR,
    ) -> None:
        """``failures``: the level an evaluation failure is logged at (ERROR: the policy the
        broker runs; a candidate's caller, which reports the failure itself, lowers it)."""
        module = _module(compiled)
        self._failures = failures
        self._entrypoint_name = entrypoint
        self._store = wasmtime.Store(_ENGINE)
        self._fuel = fuel
        self._compiled = compiled
        self._memory = wasmtime.Memory(
            self._store, wasmtime.MemoryType(wasmtime.Limits(INITIAL_PAGES, MAX_MEMORY_PAGES))
        )
        self._abort_message: str | None = None
        self._builtins: dict[int, Callable[[list[Any]], Any]] = {}
        self._store.set_fuel(self._fuel)  # instantiation and data loading run code too
        self._instance = wasmtime.Instance(self._store, module, self._imports(module))
        self._exports = self._instance.exports(self._store)
        self._check_abi()
        self._bind_builtins()
        self._entrypoint = self._entrypoint_id()
        self._data_addr = self._parse_json(json.dumps(dict(compiled.data)).encode())
        self._base = int(self._call("opa_heap_ptr_get"))
        self._opa_eval = _RawCall(self._store, self._exports["opa_eval"], params=7)

    @property
    def digest(self) -> str:
        return self._compiled.digest

    def evaluate(self, policy_input: Mapping[str, Any]) -> Any:
        """The entrypoint's result for ``policy_input`` (``None`` when undefined).

        Raises:
            EvaluationFailed: ``policy_unavailable`` on a runtime error, an exhausted budget,
                or an unreadable result. The log line and ``problem`` carry OPA's message (rule
                and location); the client sees only ``policy evaluation failed``.
        """
        return self.evaluate_encoded(
            json.dumps(policy_input, separators=(",", ":"), ensure_ascii=False).encode(
                "utf-8", "backslashreplace"
            )
        )

    def evaluate_encoded(self, raw: bytes) -> Any:
        """``evaluate`` for an input already written as UTF-8 JSON (the release path has its
        canonical bytes for the input digest: the same bytes are evaluated)."""
        self._ensure_memory(self._base + len(raw) + 64 * PAGE)
        ctypes.memmove(
            ctypes.addressof(self._memory.data_ptr(self._store).contents) + self._base,
            raw,
            len(raw),
        )
        self._store.set_fuel(self._fuel)
        self._abort_message = None
        try:
            address = self._opa_eval(
                0, self._entrypoint, self._data_addr, self._base, len(raw), self._base + len(raw), 0
            )
        except (wasmtime.WasmtimeError, wasmtime.Trap, _Abort) as exc:
            problem = self._abort_message or str(exc).splitlines()[0]
            log.log(self._failures, "policy %s: evaluation failed: %s", self.digest, problem)
            raise EvaluationFailed(problem) from exc
        try:
            results = json.loads(self._read_cstring(int(address)))
        except ValueError as exc:
            log.log(self._failures, "policy %s: result is not JSON", self.digest, exc_info=True)
            raise EvaluationFailed("its result is not JSON") from exc
        if not results:
            return None
        return results[0].get("result")

    # --- ABI plumbing ---------------------------------------------------------------------

    def _imports(self, module: wasmtime.Module) -> list[Any]:
        i32 = wasmtime.ValType.i32()
        imports: list[Any] = []
        for item in module.imports:
            name = item.name
            if name == "memory":
                imports.append(self._memory)
            elif name == "opa_abort":
                imports.append(
                    wasmtime.Func(self._store, wasmtime.FuncType([i32], []), self._abort)
                )
            elif name == "opa_println":
                imports.append(
                    wasmtime.Func(self._store, wasmtime.FuncType([i32], []), self._println)
                )
            elif name is not None and name.startswith("opa_builtin") and name[-1].isdigit():
                arity = int(name[-1])
                imports.append(
                    wasmtime.Func(
                        self._store,
                        wasmtime.FuncType([i32] * (arity + 2), [i32]),
                        self._dispatch,
                    )
                )
            else:
                raise PolicyLoadError(f"policy.wasm imports {item.module}.{name}, unknown here")
        return imports

    def _check_abi(self) -> None:
        version = (
            int(self._global("opa_wasm_abi_version")),
            int(self._global("opa_wasm_abi_minor_version")),
        )
        if version < MIN_ABI:
            raise PolicyLoadError(f"OPA Wasm ABI {version} is older than {MIN_ABI}")

    def _global(self, name: str) -> int:
        value = self._exports[name]
        if isinstance(value, wasmtime.Global):
            return int(value.value(self._store))
        return int(self._call(name))

    def _bind_builtins(self) -> None:
        wanted = json.loads(
            self._read_cstring(int(self._call("opa_json_dump", self._call("builtins"))))
        )
        missing = sorted(set(wanted) - set(HOST_BUILTINS))
        if missing:
            raise PolicyLoadError(
                "the policy uses builtins the Wasm engine does not implement: "
                f"{', '.join(missing)}; use the OPA server engine"
                ' ([policy] engine = "opa") for it'
            )
        self._builtins = {int(ident): HOST_BUILTINS[name] for name, ident in wanted.items()}

    def _entrypoint_id(self) -> int:
        entrypoints = json.loads(
            self._read_cstring(int(self._call("opa_json_dump", self._call("entrypoints"))))
        )
        if self._entrypoint_name not in entrypoints:
            raise PolicyLoadError(
                f"{self._compiled.source}: the module has no entrypoint {self._entrypoint_name} "
                "(build it with `broker policy build`)"
            )
        return int(entrypoints[self._entrypoint_name])

    def _dispatch(self, builtin_id: int, _context: int, *arg_addrs: int) -> int:
        implementation = self._builtins.get(builtin_id)
        if implementation is None:
            self._abort_message = f"unknown builtin id {builtin_id}"
            raise _Abort(self._abort_message)
        try:
            args = [
                parse_rego_value(self._read_cstring(int(self._call("opa_value_dump", a))))
                for a in arg_addrs
            ]
            result = implementation(args)
        except (_BuiltinUndefined, ValueError, TypeError) as exc:
            self._abort_message = f"builtin failed: {exc}"
            raise _Abort(self._abort_message) from exc
        return self._parse_json(json.dumps(result).encode("utf-8", "backslashreplace"))

    def _abort(self, address: int) -> None:
        self._abort_message = self._read_cstring(address)
        raise _Abort(self._abort_message)

    def _println(self, address: int) -> None:
        log.info("policy print: %s", self._read_cstring(address))

    def _parse_json(self, raw: bytes) -> int:
        address = int(self._call("opa_malloc", len(raw)))
        self._memory.write(self._store, raw, address)
        parsed = int(self._call("opa_json_parse", address, len(raw)))
        if parsed == 0:
            raise PolicyLoadError("the module could not parse a JSON document")
        return parsed

    def _read_cstring(self, address: int) -> str:
        """The NUL-terminated string at ``address``, read in bounded blocks (never past the
        memory's end or ``MAX_RESULT_BYTES``)."""
        size = self._memory.data_len(self._store)
        base = ctypes.addressof(self._memory.data_ptr(self._store).contents)
        end = address
        chunk = 4096
        data = bytearray()
        while 0 <= end < size and len(data) < MAX_RESULT_BYTES:
            block = ctypes.string_at(base + end, min(chunk, size - end))
            nul = block.find(0)
            if nul >= 0:
                data += block[:nul]
                return data.decode("utf-8", "replace")
            data += block
            end += chunk
        raise ValueError("unterminated string in Wasm memory")

    def _ensure_memory(self, needed: int) -> None:
        have = self._memory.data_len(self._store)
        if needed > have:
            pages = (needed - have + PAGE - 1) // PAGE
            if not self._memory.grow(self._store, pages):
                raise UpstreamError("policy input too large", code=ErrorCode.POLICY_UNAVAILABLE)

    def _call(self, name: str, *args: int) -> Any:
        function = self._exports[name]
        assert isinstance(function, wasmtime.Func)  # noqa: S101 - ABI exports are functions
        return function(self._store, *args)


class _RawCall:
    """An exported function of i32 parameters and one i32 result, called through wasmtime's
    unchecked C entry point into one reused argument array.

    ``Func.__call__`` rebuilds the function's type and converts every argument through
    ``Val`` on each call: ~60 µs of Python for a 7-argument ``opa_eval`` whose evaluation of
    the shipped policy takes ~50 µs (``bench/policy_bench.py``). The type is checked once here
    instead, which is what makes the unchecked call sound; traps and host-function exceptions
    surface exactly as with ``Func.__call__`` (the same ``enter_wasm``)."""

    def __init__(self, store: wasmtime.Store, function: Any, *, params: int) -> None:
        if not isinstance(function, wasmtime.Func):
            raise PolicyLoadError("an OPA ABI export is not a function")
        kind = wasmtime.ValType.i32()
        signature = function.type(store)
        if list(signature.params) != [kind] * params or list(signature.results) != [kind]:
            raise PolicyLoadError(f"an OPA ABI export does not take {params} i32 arguments")
        self._store = store
        self._function = function
        self._args = (wasm_ffi.wasmtime_val_raw_t * params)()

    def __call__(self, *args: int) -> int:
        raw = self._args
        if len(args) != len(raw):
            raise TypeError(f"{len(raw)} arguments expected, {len(args)} given")
        for index, value in enumerate(args):
            raw[index].i32 = value
        with enter_wasm(self._store) as trap:
            error = wasm_ffi.wasmtime_func_call_unchecked(
                self._store._context(),
                ctypes.byref(self._function._func),
                raw,
                len(raw),
                trap,
            )
            if error:
                raise wasmtime.WasmtimeError._from_ptr(error)
        return int(raw[0].i32) & 0xFFFFFFFF


class WasmPolicyEngine:
    """``PolicyEngine`` over a ``WasmPolicyInstance``; ``swap`` replaces it atomically."""

    def __init__(self, compiled: CompiledPolicy) -> None:
        self._instance = WasmPolicyInstance(compiled)

    @property
    def digest(self) -> str:
        return self._instance.digest

    async def evaluate(
        self, policy_input: Mapping[str, Any], *, encoded: bytes | None = None
    ) -> Decision:
        instance = self._instance  # one reference: a swap mid-request cannot mix policies
        result = (
            instance.evaluate(policy_input)
            if encoded is None
            else instance.evaluate_encoded(encoded)
        )
        return Decision.from_result(result, instance.digest)

    def swap(self, compiled: CompiledPolicy) -> None:
        """Load ``compiled`` fully, then make it the policy in force (never half of each)."""
        self._instance = WasmPolicyInstance(compiled)

    def close(self) -> None:
        """Nothing to release: the module lives as long as the engine object."""

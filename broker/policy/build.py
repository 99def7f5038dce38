"""Compiling and loading policies with the pinned ``opa``: the same tool security teams use.

* ``compile_policy_dir``: read the directory once (``bundle.load_policy_dir``), stage those
  bytes in a private directory, ``opa check --strict``, the structure rules (``opa parse``),
  optionally ``opa test``, then ``opa build -t wasm`` of the modules plus a generated wrapper
  whose one rule, ``data.broker_internal.decision.result``, is ``{allow, reasons, mask}`` of
  ``data.broker.release``. The result is the bundle ``broker policy build`` writes: the Rego
  sources, ``policy.wasm``, ``data.json`` and a ``.manifest`` with the revision and the source
  directory's digest. Its digest is the policy digest, the same for the directory served as it
  is and for the bundle built from it.
* ``load_bundle``: a bundle read once, verified by ``opa_bundle.read_bundle`` (OPA's signature
  format, checked by the broker itself), then held to the structure rules
  (``structure.check_bundle_structure``) whoever built it; the Wasm that decides is the one the
  pinned ``opa`` compiles from the Rego those rules passed (for a ``broker policy build`` bundle,
  byte for byte the one it carries), so a ``policy.wasm`` built from anything else never runs.

Every call that runs ``opa`` is a subprocess: callers run these off the event loop (start-up,
reload, CLI).
"""

from __future__ import annotations

import json
import logging
import os
import tarfile
import tempfile
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.serialization import load_pem_private_key

from broker.policy import opa_bundle
from broker.policy.bundle import PolicySource, load_policy_dir
from broker.policy.freshness import EXPIRES_CLAIM, VERSION_CLAIM, Freshness
from broker.policy.inputs import PolicyInput, read_policy_input
from broker.policy.structure import (
    WRAPPER,
    WRAPPER_PACKAGE,
    check_bundle_structure,
    check_structure,
    run_opa,
)
from broker.policy.user_paths import naming_user_files
from broker.policy.wasm import ENTRYPOINT, CompiledPolicy, PolicyLoadError

__all__ = ["WRAPPER", "run_opa"]  # re-exported: callers and tests import them from here
log = logging.getLogger(__name__)
MAX_BUNDLE_BYTES = opa_bundle.MAX_BUNDLE_BYTES
MAX_REVISION_CHARS = 256
MAX_SCOPE_CHARS = 256


def check_policy_dir(policy_dir: Path, *, opa: Path) -> str:
    """``opa check --strict`` over the directory; returns OPA's output.

    Raises:
        PolicyLoadError: with OPA's message verbatim when the check fails.
    """
    done = run_opa(opa, "check", "--strict", str(policy_dir))
    if done.returncode != 0:
        raise PolicyLoadError(f"opa check --strict failed:\n{(done.stdout + done.stderr).strip()}")
    return done.stdout + done.stderr


def compile_policy_dir(
    policy_dir: Path, *, opa: Path, revision: str = "", run_tests: bool = False
) -> CompiledPolicy:
    """Read, check, (test,) and compile a policy directory into the broker's bundle.

    Raises:
        ConfigError / PolicyLoadError: unreadable directory, structure, check, test or
            compile errors (OPA's message verbatim).
    """
    return compile_policy_source(
        load_policy_dir(policy_dir), opa=opa, revision=revision, run_tests=run_tests
    )


def compile_policy_source(
    source: PolicySource, *, opa: Path, revision: str = "", run_tests: bool = False
) -> CompiledPolicy:
    """``compile_policy_dir`` for a directory already read once (``source``).

    Raises:
        PolicyLoadError: structure, check, test or compile errors (OPA's message verbatim).
    """
    if len(revision) > MAX_REVISION_CHARS or not revision.isprintable():
        raise PolicyLoadError(f"--revision must be printable, at most {MAX_REVISION_CHARS}")
    policy_dir = source.root
    with (
        tempfile.TemporaryDirectory(prefix="broker-policy-") as tmp,
        naming_user_files(Path(tmp) / "policy", str(policy_dir)),
    ):
        staged = Path(tmp) / "policy"
        _stage(source.files, staged)
        check_policy_dir(staged, opa=opa)
        check_structure(source, staged, opa=opa)
        if run_tests and source.test_modules:
            done = run_opa(opa, "test", str(staged))
            if done.returncode != 0:
                raise PolicyLoadError(f"opa test failed:\n{(done.stdout + done.stderr).strip()}")
        _stage({WRAPPER_PACKAGE: WRAPPER.encode()}, staged)
        output = Path(tmp) / "built.tar.gz"
        done = run_opa(
            opa,
            *("build", "-b", "-t", "wasm", "-e", ENTRYPOINT, "--ignore", "*_test.rego"),
            *("-o", str(output), "policy"),
            cwd=Path(tmp),
        )
        if done.returncode != 0:
            raise PolicyLoadError(f"opa build failed:\n{(done.stdout + done.stderr).strip()}")
        built = _opa_output(output)
    files = {name: source.files[name] for name in source.modules}
    files[WRAPPER_PACKAGE] = WRAPPER.encode()
    files[opa_bundle.WASM] = built[opa_bundle.WASM]
    files[opa_bundle.DATA] = built.get(opa_bundle.DATA, b"{}")
    files[opa_bundle.MANIFEST] = _manifest(revision, source.digest)
    return _compiled(files, source=str(policy_dir))


def _opa_output(path: Path) -> dict[str, bytes]:
    """``policy.wasm`` and ``data.json`` of what our own ``opa build`` just wrote into our private
    directory (OPA names entries with a leading ``/`` and uses PAX headers for long names, which
    the strict reader of untrusted bundles refuses)."""
    found: dict[str, bytes] = {}
    with tarfile.open(path, mode="r:gz") as archive:
        for member in archive.getmembers():
            name = member.name.lstrip("/")
            if member.isreg() and name in (opa_bundle.WASM, opa_bundle.DATA):
                extracted = archive.extractfile(member)
                if extracted is not None:
                    found[name] = extracted.read()
    if opa_bundle.WASM not in found:
        raise PolicyLoadError("opa build wrote no policy.wasm")
    return found


def _stage(files: dict[str, bytes] | Any, root: Path) -> None:
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)


def _manifest(revision: str, source_digest: str) -> bytes:
    manifest = {
        "revision": revision,
        "roots": [""],
        "rego_version": 1,
        "wasm": [{"entrypoint": ENTRYPOINT, "module": opa_bundle.WASM}],
        "metadata": {"broker": {"source_digest": source_digest}},
    }
    return json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()


def _compiled(files: dict[str, bytes], *, source: str) -> CompiledPolicy:
    """The engine's view of verified bundle files (the manifest must name our entrypoint)."""
    verified = opa_bundle.read_bundle(opa_bundle.pack(files), source=source, verification=None)
    return _from_verified(verified, source)


def _from_verified(verified: opa_bundle.VerifiedBundle, source: str) -> CompiledPolicy:
    wasm_entries = verified.manifest.get("wasm", [])
    entrypoints = [w.get("entrypoint") for w in wasm_entries if isinstance(w, dict)]
    if entrypoints and ENTRYPOINT not in entrypoints:
        raise PolicyLoadError(f"{source}: the bundle's entrypoints {entrypoints} lack {ENTRYPOINT}")
    return CompiledPolicy(
        wasm=verified.wasm,
        data=verified.data,
        digest=verified.digest,
        source=source,
        files=verified.files,
        revision=verified.revision,
        source_digest=verified.source_digest,
        claims=verified.claims,
    )


DEFAULT_EXPIRES_SECONDS = 30 * 24 * 3600


def default_freshness(
    environ: Mapping[str, str], now: float, *, expires_in: int = DEFAULT_EXPIRES_SECONDS
) -> Freshness:
    """Version = the build time in Unix seconds (``SOURCE_DATE_EPOCH`` when set, as reproducible
    builds define it, else ``now``), expiry = that time + ``expires_in``.

    Raises:
        PolicyLoadError: ``SOURCE_DATE_EPOCH`` that is not a positive integer.
    """
    epoch = environ.get("SOURCE_DATE_EPOCH") or None  # empty: unset
    if epoch is not None and not epoch.strip().isdigit():
        raise PolicyLoadError("SOURCE_DATE_EPOCH must be Unix seconds")
    built = int(epoch) if epoch is not None else int(now)
    return Freshness(version=built, expires=built + expires_in)


def build_bundle(
    policy: Path | PolicyInput,
    output: Path,
    *,
    opa: Path,
    signing_key: Path | None = None,
    revision: str = "",
    scope: str = "",
    freshness: Freshness | None = None,
) -> CompiledPolicy:
    """``broker policy build``: the directory's bundle, tested, optionally signed in OPA's
    format, written reproducibly (two builds of one directory, revision, scope and freshness
    are byte-identical). A signature carries ``scope`` (the environment, required) and the
    freshness claims (``policy_version``, ``policy_expires``; default ``default_freshness``).
    From a bundle (``broker policy build``'s or OPA's, verified and held to the load rules):
    its files as they are, the manifest's ``revision`` replaced when one is given, signed
    again — the digest does not change.

    Raises:
        PolicyLoadError: with OPA's compiler message verbatim, an unusable signing key, or a
            signature without a scope.
    """
    if signing_key is not None and not (0 < len(scope) <= MAX_SCOPE_CHARS and scope.isprintable()):
        raise PolicyLoadError(
            "a signed bundle needs --scope naming its environment (printable, at most "
            f"{MAX_SCOPE_CHARS} characters): the broker requires bundle_verification_scope"
        )
    if isinstance(policy, Path):
        policy = read_policy_input(policy)
    if policy.verified is not None:
        compiled, files = _rebuilt(policy.verified, str(policy.path), opa, revision)
    else:
        assert policy.source is not None  # noqa: S101 - a directory input was read as one
        compiled = compile_policy_source(policy.source, opa=opa, revision=revision, run_tests=True)
        files = dict(compiled.files)
    if signing_key is not None:
        try:
            key = load_pem_private_key(signing_key.read_bytes(), None)
        except (OSError, ValueError, TypeError) as exc:
            raise PolicyLoadError(f"{signing_key} is not an unencrypted PEM private key") from exc
        fresh = freshness or default_freshness(os.environ, time.time())
        claims = {VERSION_CLAIM: fresh.version, EXPIRES_CLAIM: fresh.expires}
        files[opa_bundle.SIGNATURES] = opa_bundle.signatures_file(
            files, key, scope=scope, claims=claims
        )
        compiled = replace(compiled, claims={**claims, "scope": scope})
    temporary = output.with_name(f".{output.name}.tmp")
    temporary.write_bytes(opa_bundle.pack(files))
    os.replace(temporary, output)
    return compiled


def _rebuilt(
    verified: opa_bundle.VerifiedBundle, source: str, opa: Path, revision: str
) -> tuple[CompiledPolicy, dict[str, bytes]]:
    """A verified bundle's files for ``build_bundle`` (signature dropped, revision replaced).

    Raises:
        PolicyLoadError: outside the load rules, or a revision that is not printable.
    """
    if len(revision) > MAX_REVISION_CHARS or not revision.isprintable():
        raise PolicyLoadError(f"--revision must be printable, at most {MAX_REVISION_CHARS}")
    compiled = load_verified_bundle(verified, source=source, opa=opa)
    files = {name: c for name, c in verified.files.items() if name != opa_bundle.SIGNATURES}
    if revision:
        manifest = files.get(opa_bundle.MANIFEST, b"{}")
        files[opa_bundle.MANIFEST] = opa_bundle.with_revision(manifest, revision, source=source)
    rebuilt = replace(
        compiled,
        files=files,
        digest=opa_bundle.files_digest(files),
        revision=revision or compiled.revision,
        claims={},
    )
    return rebuilt, files


def load_bundle(
    path: Path, *, opa: Path, verification_key: Path | None = None, scope: str = ""
) -> CompiledPolicy:
    """A bundle read once and verified (signature required when ``verification_key`` is set).

    Raises:
        PolicyLoadError: unreadable, unsigned, badly signed, malformed, not a broker bundle, or
            outside the structure rules.
    """
    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_BUNDLE_BYTES + 1)
    except OSError as exc:
        raise PolicyLoadError(f"cannot read the bundle {path}") from exc
    return load_bundle_bytes(
        raw, source=str(path), verification_key=verification_key, scope=scope, opa=opa
    )


def load_bundle_bytes(
    raw: bytes,
    *,
    source: str,
    opa: Path,
    verification_key: Path | None = None,
    scope: str = "",
) -> CompiledPolicy:
    """``load_bundle`` for bytes already read once (a file, a bundle server's answer):

    1. ``opa_bundle.read_bundle``: the archive, and the signature when a key is configured;
    2. the structure rules on the bundle's Rego and data (``check_bundle_structure``);
    3. the Wasm the pinned ``opa`` compiles from that Rego is
       the one that decides (a bundle's own ``policy.wasm`` compiled from other sources is
       replaced, and the server log says so).

    Raises:
        PolicyLoadError: as ``load_bundle``.
    """
    verification = opa_bundle.verification_from_file(verification_key, scope)
    verified = opa_bundle.read_bundle(raw, source=source, verification=verification)
    return load_verified_bundle(verified, source=source, opa=opa)


def load_verified_bundle(
    verified: opa_bundle.VerifiedBundle, *, source: str, opa: Path
) -> CompiledPolicy:
    """Steps 2-3 of ``load_bundle_bytes`` on a bundle ``read_bundle`` verified.

    Raises:
        PolicyLoadError: outside the structure rules, or its Rego does not compile.
    """
    compiled = _from_verified(verified, source)
    wasm = _checked_wasm(verified, source, opa)
    if wasm != compiled.wasm:
        log.warning("%s: its policy.wasm is not the pinned opa's build of its Rego; "
                    "the broker runs its own build", source)  # fmt: skip
        compiled = replace(compiled, wasm=wasm)
    return compiled


def bundle_as_built(verified: opa_bundle.VerifiedBundle, *, source: str) -> CompiledPolicy:
    """A verified bundle decided by its own ``policy.wasm``: ``broker policy eval``/``replay``
    where no OPA is installed. The server never loads a bundle so: it also holds the bundle's
    Rego to the structure rules and runs the pinned ``opa``'s build of it (``load_bundle_bytes``).

    Raises:
        PolicyLoadError: its manifest does not name the broker's entrypoint.
    """
    return _from_verified(verified, source)


def _checked_wasm(verified: opa_bundle.VerifiedBundle, source: str, opa: Path) -> bytes:
    """The bundle's Rego and data staged as ``compile_policy_dir`` stages a directory, held to
    the structure rules, and compiled by ``opa`` (the same build: same paths, same flags)."""
    rego = {name: content for name, content in verified.files.items() if name.endswith(".rego")}
    with (
        tempfile.TemporaryDirectory(prefix="broker-bundle-") as tmp,
        naming_user_files(Path(tmp) / "policy", f"{source}:"),
    ):
        staged = Path(tmp) / "policy"
        _stage(rego, staged)
        check_bundle_structure(verified.files, verified.data, staged, source=source, opa=opa)
        _stage({opa_bundle.DATA: json.dumps(dict(verified.data)).encode()}, staged)
        output = Path(tmp) / "built.tar.gz"
        done = run_opa(
            opa,
            *("build", "-b", "-t", "wasm", "-e", ENTRYPOINT, "-o", str(output), "policy"),
            cwd=Path(tmp),
        )
        if done.returncode != 0:
            raise PolicyLoadError(
                f"{source}: opa build of the bundle's Rego failed:\n"
                f"{(done.stdout + done.stderr).strip()}"
            )
        return _opa_output(output)[opa_bundle.WASM]


def compile_entrypoints(
    policy_dir: Path, entrypoints: list[str], *, opa: Path, with_tests: bool = True
) -> CompiledPolicy:
    """A module with the given entrypoints (``broker policy test`` compiles the test rules).

    Raises:
        PolicyLoadError: with OPA's message.
    """
    with tempfile.TemporaryDirectory(prefix="broker-policy-") as tmp:
        output = Path(tmp) / "bundle.tar.gz"
        args = ["build", "-t", "wasm"]
        for entrypoint in entrypoints:
            args += ["-e", entrypoint]
        if not with_tests:
            args += ["--ignore", "*_test.rego"]
        done = run_opa(opa, *args, "-o", str(output), str(policy_dir))
        if done.returncode != 0:
            raise PolicyLoadError(f"opa build failed:\n{(done.stdout + done.stderr).strip()}")
        built = _opa_output(output)
    data = json.loads(built.get(opa_bundle.DATA, b"{}"))
    return CompiledPolicy(
        wasm=built[opa_bundle.WASM], data=data, digest="tests", source=str(policy_dir)
    )

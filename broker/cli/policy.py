"""``broker policy …``: the security team's workflow, on OPA's own tools and the broker's engine.

write → ``fmt`` / ``check`` / ``test`` → ``eval`` → ``replay`` against past decisions → ``build``
a (signed) bundle → reload. Exit codes: 0 success (``replay`` exits 0 even when decisions
change); 1 the answer is "no" (check or tests failed); 2 bad usage, unreadable input, or a
policy that does not compile.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from broker.cli.policy_replay import replay, since_time
from broker.core.errors import ConfigError, FileFormatError
from broker.core.jsonsafe import loads_bounded
from broker.policy.build import (
    build_bundle,
    bundle_as_built,
    check_policy_dir,
    compile_entrypoints,
    compile_policy_source,
    default_freshness,
    load_verified_bundle,
    run_opa,
)
from broker.policy.engine import Decision
from broker.policy.freshness import MAX_VERSION
from broker.policy.input_lint import lint_input_paths
from broker.policy.inputs import PolicyInput, read_policy_input, staged
from broker.policy.structure import WRAPPER_PACKAGE
from broker.policy.testing import OPA_ENV, find_opa
from broker.policy.wasm import CompiledPolicy, WasmPolicyInstance

EXIT_NO = 1
EXIT_USAGE = 2


def add_commands(policy: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        parser = policy.add_parser(name, help=help_text)
        parser.add_argument(
            "--opa", help="path of the opa binary (default: found as the broker does)"
        )
        return parser

    check = command("check", "opa check --strict, structure rules, and an input-schema lint")
    _policy_argument(check)
    check.add_argument("--strict", action="store_true", help="warnings fail the check (for CI)")
    check.set_defaults(run=_existing("policy", _check))
    fmt = command("fmt", "opa fmt (rewrites files; --check only lists what would change)")
    _policy_argument(fmt)
    fmt.add_argument("--check", action="store_true")
    fmt.set_defaults(run=_existing("policy", _fmt))
    test = command("test", "the Rego unit tests with OPA and through the broker's engine")
    _policy_argument(test, default=Path("policies"))
    test.set_defaults(run=_existing("policy", _test))
    evaluate = command("eval", "decide one input as the broker would")
    evaluate.add_argument("--policy", type=Path, default=Path("policies"), help=POLICY_HELP)
    evaluate.add_argument("--input", required=True, help="FILE, or - for standard input")
    evaluate.add_argument("--explain", action="store_true", help="OPA's trace (opa eval)")
    evaluate.add_argument("--verification-key", type=Path, help="PEM: a signed BUNDLE's key")
    evaluate.add_argument("--scope", default="", help="the signed BUNDLE's scope (environment)")
    evaluate.set_defaults(run=_existing("policy", _eval))
    replay = command("replay", "re-decide logged decisions with a candidate policy")
    replay.add_argument("--log", type=Path, required=True, action="append")
    replay.add_argument("--policy", type=Path, default=Path("policies"), help=POLICY_HELP)
    replay.add_argument("--since", help="RFC 3339: only decisions at or after this time")
    replay.add_argument("--key", help="only decisions about this key")
    replay.add_argument("--verification-key", type=Path, help="PEM: a signed BUNDLE's key")
    replay.add_argument("--scope", default="", help="the signed BUNDLE's scope (environment)")
    replay.set_defaults(run=_existing("policy", _replay))
    build = command("build", "an OPA bundle (Wasm) for deployment, optionally signed")
    build.add_argument("policy", type=Path, metavar="POLICY", help=POLICY_HELP)
    build.add_argument(
        "--verification-key",
        type=Path,
        help="PEM: a signed input BUNDLE's key (its scope must be --scope)",
    )
    build.add_argument("-o", "--output", type=Path, required=True)
    build.add_argument("--signing-key", type=Path, help="PEM private key (RSA or EC P-256)")
    build.add_argument(
        "--revision", default="", help="written into .manifest and logged (e.g. the git commit)"
    )
    build.add_argument(
        "--scope",
        default="",
        help="with --signing-key (required): the environment the bundle is for, e.g. prod; "
        "brokers refuse it unless their bundle_verification_scope is the same",
    )
    build.add_argument(
        "--version",
        type=int,
        dest="policy_version",
        help="with --signing-key: policy_version, a positive integer every published bundle "
        "must raise (default: the build time in Unix seconds, SOURCE_DATE_EPOCH when set)",
    )
    build.add_argument(
        "--expires-in",
        default="30d",
        help="with --signing-key: how long brokers accept the bundle after the build time, "
        "e.g. 30d, 12h, 90m, 3600s (default 30d)",
    )
    build.set_defaults(run=_existing("policy", _build))


POLICY_HELP = "a policy DIR, its ConfigMap mount, or a BUNDLE (.tar.gz)"


def _policy_argument(parser: argparse.ArgumentParser, default: Path | None = None) -> None:
    """The input every ``broker policy`` command takes, and a signed bundle's key and scope."""
    if default is None:
        parser.add_argument("policy", type=Path, metavar="POLICY", help=POLICY_HELP)
    else:
        parser.add_argument(
            "policy", type=Path, metavar="POLICY", nargs="?", default=default, help=POLICY_HELP
        )
    parser.add_argument("--verification-key", type=Path, help="PEM: a signed BUNDLE's key")
    parser.add_argument("--scope", default="", help="the signed BUNDLE's scope (environment)")


POLICY_FIX = (
    "name a policy directory (Rego modules and data.json, or a ConfigMap mount) or a bundle "
    "`broker policy build` wrote"
)


def _existing(
    attribute: str, run: Callable[[argparse.Namespace], int]
) -> Callable[[argparse.Namespace], int]:
    """``run``, once the policy path in ``args.<attribute>`` is known to exist.

    Raises:
        FileFormatError: one line naming the missing path and what to name instead (exit 2).
    """

    def checked(args: argparse.Namespace) -> int:
        path: Path = getattr(args, attribute)
        if not path.exists():
            raise FileFormatError(path, "no such file or directory", POLICY_FIX)
        return run(args)

    return checked


def _opa(args: argparse.Namespace) -> Path:
    return find_opa(args.opa)


def _input(args: argparse.Namespace) -> PolicyInput:
    """``args.policy`` read once (a directory, a ConfigMap mount or a verified bundle).

    Raises:
        ConfigError / PolicyLoadError: it does not read or verify (naming the user's files).
    """
    return read_policy_input(args.policy, verification_key=args.verification_key, scope=args.scope)


def _loaded(policy: PolicyInput, opa: Path) -> CompiledPolicy:
    """The policy as ``broker serve`` loads it: compiled, or verified and held to the rules.

    Raises:
        PolicyLoadError: it does not load (naming the user's files).
    """
    if policy.verified is not None:
        return load_verified_bundle(policy.verified, source=str(policy.path), opa=opa)
    assert policy.source is not None  # noqa: S101 - a directory input was read as one
    return compile_policy_source(policy.source, opa=opa)


def _check(args: argparse.Namespace) -> int:
    opa = _opa(args)
    policy = _input(args)
    with staged(policy) as root:
        print(policy.user_text(check_policy_dir(root, opa=opa), root).strip()
              or "opa check --strict: ok")  # fmt: skip
        warnings = list(lint_input_paths(root))
    compiled = _loaded(policy, opa)
    print(
        "structure: ok (broker/release.rego decides; other modules are "
        "broker.key_policies.<name>; other data only under data.broker.key_requirements)"
    )
    print(f"policy digest: {compiled.digest}")
    for warning in warnings:
        print(f"warning: {policy.shown}{'' if policy.bundle else '/'}{warning}")
    print(f"input lint: {len(warnings)} warning(s)")
    if warnings and args.strict:
        print("error: --strict: warnings fail the check", file=sys.stderr)
        return EXIT_NO
    return 0


def _fmt(args: argparse.Namespace) -> int:
    opa = _opa(args)
    policy = _input(args)
    if not args.check:
        if policy.kind != "directory":
            raise ConfigError(
                "fmt",
                f"{args.policy} is a {policy.kind}: fmt rewrites files in the source directory "
                "(run it there), or --check lists what would change",
            )
        done = run_opa(opa, "fmt", "-w", str(args.policy))
        print((done.stdout + done.stderr).strip() or "formatted")
        return 0 if done.returncode == 0 else EXIT_NO
    ours = {name: c for name, c in policy.files.items() if name != WRAPPER_PACKAGE}
    with staged(replace(policy, files=ours)) as root:  # the generated wrapper is the broker's
        done = run_opa(opa, "fmt", "--list", "--fail", str(root))
        print(policy.user_text(done.stdout + done.stderr, root).strip() or "formatted")
    return 0 if done.returncode == 0 else EXIT_NO


def _test(args: argparse.Namespace) -> int:
    """OPA's verdict per test, and the same test rules evaluated by the broker's Wasm engine."""
    opa = _opa(args)
    policy = _input(args)
    with staged(policy) as root:
        done = run_opa(opa, "test", "--format", "json", str(root))
        try:
            results = json.loads(done.stdout) if done.stdout.strip() else []
        except ValueError:
            print(policy.user_text(done.stdout + done.stderr, root).strip(), file=sys.stderr)
            return EXIT_NO
        if not results:
            problem = done.stderr.strip() if done.returncode not in (0, 2) else ""
            print(policy.user_text(problem, root) or _no_tests(policy), file=sys.stderr)
            return EXIT_NO
        entrypoints = {
            f"{r['package'].removeprefix('data.').replace('.', '/')}/{r['name']}": r
            for r in results
        }
        compiled = compile_entrypoints(root, sorted(entrypoints), opa=opa)
    return _test_verdicts(results, entrypoints, compiled)


def _no_tests(policy: PolicyInput) -> str:
    if policy.bundle:
        return (
            f"no tests in {policy.path}: a bundle carries none (`broker policy build` leaves "
            "*_test.rego out); run `broker policy test` on the directory it was built from"
        )
    return f"no tests in {policy.path}: add *_test.rego files (an untested policy is not shippable)"


def _test_verdicts(
    results: list[dict[str, Any]], entrypoints: dict[str, dict[str, Any]], compiled: CompiledPolicy
) -> int:
    failures = differences = 0
    for entrypoint, result in sorted(entrypoints.items()):
        opa_pass = not result.get("fail") and not result.get("error")
        broker_pass = WasmPolicyInstance(compiled, entrypoint=entrypoint).evaluate({}) is True
        failures += not opa_pass
        differences += opa_pass != broker_pass
        verdict = "PASS" if opa_pass else "FAIL"
        agree = (
            ""
            if opa_pass == broker_pass
            else f"  <- the broker's engine says {'PASS' if broker_pass else 'FAIL'}"
        )
        print(f"{verdict} {entrypoint}{agree}")
    print(
        f"{len(results) - failures}/{len(results)} passed (OPA); "
        f"{differences} difference(s) with the broker's engine"
    )
    return 0 if failures == 0 and differences == 0 else EXIT_NO


def _opa_if_any(args: argparse.Namespace) -> Path | None:
    """OPA where one is found; ``eval`` and ``replay`` of a bundle run without it."""
    try:
        return _opa(args)
    except ConfigError:
        if args.opa:
            raise  # the user named a binary that is not there: say so
        return None


def _compiled(policy: PolicyInput, opa: Path | None) -> CompiledPolicy:
    """A directory compiled with OPA; a bundle verified, and without OPA run on its own Wasm.

    Raises:
        ConfigError: a directory and no OPA (naming the directory and the two ways out).
        PolicyLoadError: the policy does not load (naming the user's files).
    """
    if opa is not None:
        return _loaded(policy, opa)
    if policy.verified is None:
        raise ConfigError(
            "--policy",
            f"{policy.path} is a policy {policy.kind}: compiling its Rego needs OPA, and none "
            f"was found (--opa, ${OPA_ENV}, PATH). Build a bundle with `broker policy build` "
            "where OPA is installed, or install OPA",
        )
    print(
        f"note: no OPA here: {policy.path} is decided by its own policy.wasm (signature "
        "checked); a broker also rebuilds it from its Rego and checks the structure rules",
        file=sys.stderr,
    )
    return bundle_as_built(policy.verified, source=str(policy.path))


def _eval(args: argparse.Namespace) -> int:
    opa = _opa_if_any(args)
    raw = sys.stdin.buffer.read() if args.input == "-" else _read(Path(args.input), "--input")
    try:
        document = loads_bounded(raw)
    except ValueError as exc:
        raise ConfigError("--input", f"not JSON: {exc}") from exc
    policy = _input(args)
    compiled = _compiled(policy, opa)
    decision = Decision.from_result(
        WasmPolicyInstance(compiled).evaluate(document), compiled.digest
    )
    print(
        json.dumps(
            {
                "allow": decision.allowed,
                "reasons": list(decision.reasons),
                "policy_digest": decision.policy_digest,
            }
        )
    )
    if args.explain:
        if opa is None:
            raise ConfigError("--explain", "OPA's trace needs OPA (--opa, $BROKER_OPA, PATH)")
        with staged(policy) as root:
            done = run_opa(
                opa,
                *("eval", "--format", "pretty", "--explain", "full", "--ignore", "*_test.rego"),
                *("-d", str(root), "--stdin-input", "data.broker.release"),
                input_text=raw.decode("utf-8", "replace"),
            )
            print(policy.user_text(done.stdout + done.stderr, root), file=sys.stderr)
    return 0


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(what, f"cannot read {path}") from exc


def _replay(args: argparse.Namespace) -> int:
    since = since_time(args.since) if args.since else None
    compiled = _compiled(_input(args), _opa_if_any(args))
    return replay(args.log, compiled, since=since, key=args.key)


def _build(args: argparse.Namespace) -> int:
    freshness = None
    if args.signing_key is None:
        if args.scope or args.policy_version is not None:
            raise ConfigError("--scope", "--scope and --version go with --signing-key")
    else:
        if not args.scope:
            raise ConfigError("--scope", "a signed bundle needs the environment it is for")
        expires_in = _duration(args.expires_in)
        freshness = default_freshness(os.environ, time.time(), expires_in=expires_in)
        if args.policy_version is not None:
            if not 0 < args.policy_version <= MAX_VERSION:
                raise ConfigError("--version", "a positive integer")
            freshness = replace(freshness, version=args.policy_version)
    compiled = build_bundle(
        read_policy_input(args.policy, verification_key=args.verification_key, scope=args.scope),
        args.output,
        opa=_opa(args),
        signing_key=args.signing_key,
        revision=args.revision,
        scope=args.scope,
        freshness=freshness,
    )
    print(
        json.dumps(
            {
                "bundle": str(args.output),
                "signed": args.signing_key is not None,
                "revision": compiled.revision,
                "policy_digest": compiled.digest,
                "source_digest": compiled.source_digest,
                **(
                    {
                        "scope": args.scope,
                        "policy_version": freshness.version,
                        "policy_expires": freshness.expires_at,
                    }
                    if freshness is not None
                    else {}
                ),
            }
        )
    )
    return 0


DURATION_UNITS = {"d": 86400, "h": 3600, "m": 60, "s": 1}


def _duration(text: str) -> int:
    """``30d``, ``12h``, ``90m``, ``3600s`` (or plain seconds) as seconds.

    Raises:
        ConfigError: anything else, or not positive.
    """
    number, unit = (text[:-1], text[-1]) if text[-1:] in DURATION_UNITS else (text, "s")
    if not number.isdigit() or int(number) <= 0:
        raise ConfigError("--expires-in", f"not a duration like 30d, 12h or 3600s: {text!r}")
    return int(number) * DURATION_UNITS[unit]

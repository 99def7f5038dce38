"""The broker's bundle verification against OPA's own, on generated bundles.

Every case is a ``.tar.gz`` made here byte by byte (``tests/support/bundles.py``) from the
shipped policy's real bundle: valid ones (RSA and ECDSA signatures, reordered entries,
reformatted and unusual JSON, legacy tar headers, scopes, gzip members), re-signed and tampered
ones (every file, every signature field), and every tar entry type. Each goes to
``opa build -b BUNDLE --verification-key KEY`` (OPA's bundle reader, the oracle) and to
``opa_bundle.read_bundle``. Invariants, on every case:

1. OPA refuses it => the broker refuses it.
2. The broker accepts it => OPA accepts it and loads the very same ``policy.wasm`` and data
   (for the one ``./`` tar that OPA's own tools make, OPA is given the same files without
   ``./``: ``opa_made_cases``).
3. A case OPA accepts and the broker refuses belongs to a stricter class the broker documents
   (a non-regular tar entry, a name that is not relative and normalised, a file the broker does
   not load, a weak hash, bytes after the gzip stream, no end-of-archive marker): the broker's
   message names that rule.
4. The expected verdict of each valid and each tampered case holds for both.
"""

from __future__ import annotations

import io
import json
import subprocess
import tarfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from broker.policy import opa_bundle
from broker.policy.build import compile_policy_dir
from broker.policy.freshness import Freshness
from broker.policy.testing import find_opa
from broker.policy.wasm import PolicyLoadError
from tests.support.bundles import BLOCK, GNU, Entry, Signer, entries_of, gz, pax_record, tar

SHIPPED = Path(__file__).parents[2] / "policies"
ACCEPT, REFUSE, STRICTER = "accept", "refuse", "stricter"
STRICTER_RULES = (
    "a bundle holds only regular files",
    "is not a relative, normalised path",
    "is not a file the broker loads",
    "is not hashed with SHA-256",
    "not a gzip-compressed bundle",
    "uses the name prefix field",
    "the archive is truncated",
    "appears twice in the archive",  # two names OPA keeps apart and OPA's path rules join
    "has content",  # a directory entry whose "content" Go's reader would read as headers
)


@dataclass(frozen=True)
class Case:
    name: str
    expected: str  # ACCEPT | REFUSE | STRICTER
    raw: bytes
    key: str = "rsa"  # which verification key
    scope: str = ""
    oracle: bytes | None = None  # what OPA is given instead of ``raw`` (see opa_made_cases)


@dataclass(frozen=True)
class World:
    files: dict[str, bytes]  # the shipped policy's bundle, unsigned
    allow_all_wasm: bytes
    rsa: Any
    ec: Any
    other: Any


def private_pem(key: Any) -> bytes:
    return bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


def public_pem(key: Any) -> bytes:
    return bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    opa = find_opa()
    shipped = compile_policy_dir(SHIPPED, opa=opa)
    allow_all = tmp_path_factory.mktemp("allow-all")
    (allow_all / "broker").mkdir()
    (allow_all / "broker" / "release.rego").write_text(
        "package broker.release\nimport rego.v1\nallow := true\nreasons := set()\n"
    )
    return World(
        files=dict(shipped.files),
        allow_all_wasm=compile_policy_dir(allow_all, opa=opa).wasm,
        rsa=rsa.generate_private_key(65537, 2048),
        ec=ec.generate_private_key(ec.SECP256R1()),
        other=rsa.generate_private_key(65537, 2048),
    )


@dataclass(frozen=True)
class OpaMade:
    built: bytes  # opa build -b -t wasm … --signing-key (entries named /…)
    tarred: bytes  # opa sign in the bundle's directory, then tar czf b.tar.gz .
    tarred_plain: bytes  # the same files named /… as opa build names them (OPA's oracle)


@pytest.fixture(scope="module")
def opa_made(world: World, tmp_path_factory: pytest.TempPathFactory) -> OpaMade:
    """Made by the pinned OPA and the system's ``tar``, with the world's RSA key."""
    tmp = tmp_path_factory.mktemp("opa-made")
    (tmp / "sign.pem").write_bytes(private_pem(world.rsa))
    source = tmp / "src"
    for name, content in world.files.items():
        if name.endswith(".rego") or name == "data.json":
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            (source / name).write_bytes(content)
    opa = str(find_opa())
    build = [opa, "build", "-b", "-t", "wasm", "-e", "broker_internal/decision/result", "."]
    signing = ["--signing-key", str(tmp / "sign.pem")]
    subprocess.run([*build, "-o", str(tmp / "built.tar.gz"), *signing],
                   cwd=source, check=True, capture_output=True, timeout=120)  # fmt: skip
    subprocess.run([*build, "-o", str(tmp / "unsigned.tar.gz")],
                   cwd=source, check=True, capture_output=True, timeout=120)  # fmt: skip
    bundle_dir = tmp / "bundle"
    bundle_dir.mkdir()
    subprocess.run(["tar", "xzf", str(tmp / "unsigned.tar.gz"), "-C", str(bundle_dir)],
                   check=True, capture_output=True, timeout=60)  # fmt: skip
    subprocess.run([opa, "sign", "--signing-key", str(tmp / "sign.pem"), "--bundle", "."],
                   cwd=bundle_dir, check=True, capture_output=True, timeout=60)  # fmt: skip
    subprocess.run(["tar", "czf", str(tmp / "tarred.tar.gz"), "."],
                   cwd=bundle_dir, check=True, capture_output=True, timeout=60)  # fmt: skip
    plain = {
        str(p.relative_to(bundle_dir)): p.read_bytes() for p in bundle_dir.rglob("*") if p.is_file()
    }
    return OpaMade(
        built=(tmp / "built.tar.gz").read_bytes(),
        tarred=(tmp / "tarred.tar.gz").read_bytes(),
        tarred_plain=gz(tar(entries_of(good_rooted(plain)))),
    )


def signed(world: World, files: dict[str, bytes], key: Any = None) -> dict[str, bytes]:
    chosen = world.rsa if key is None else key
    unsigned = {n: c for n, c in files.items() if n != opa_bundle.SIGNATURES}
    return {**unsigned, opa_bundle.SIGNATURES: opa_bundle.signatures_file(unsigned, chosen)}


def pyjwt_signed(world: World, files: dict[str, bytes], **options: Any) -> dict[str, bytes]:
    extra = options.pop("extra_payload", {})
    signer = Signer(world.rsa, "RS256", extra_payload=extra)
    return {**files, opa_bundle.SIGNATURES: signer.signatures(files, **options)}


EXTRA_REGO = b"package broker.key_policies.extra\n\nimport rego.v1\n\napplies_to := set()\n"


def valid_cases(world: World) -> Iterator[Case]:
    base = world.files
    yield Case("rsa", ACCEPT, opa_bundle.pack(signed(world, base)))
    yield Case("ecdsa", ACCEPT, opa_bundle.pack(signed(world, base, world.ec)), key="ec")
    yield Case("pyjwt-signer", ACCEPT, gz(tar(entries_of(pyjwt_signed(world, base)))))
    reversed_order = dict(reversed(list(signed(world, base).items())))
    yield Case("reversed-entries", ACCEPT, gz(tar(entries_of(reversed_order))))
    data = json.loads(base["data.json"])
    reformatted = {**base, "data.json": json.dumps(data, indent=3, sort_keys=False).encode()}
    yield Case("data-reformatted", ACCEPT, gz(tar(entries_of(signed(world, reformatted)))))
    for number, odd in enumerate(ODD_DATA):
        files = {**base, "data.json": json.dumps({**data, "odd": odd}).encode()}
        yield Case(f"odd-json-{number}", ACCEPT, gz(tar(entries_of(signed(world, files)))))
    literal = (
        base["data.json"].rstrip()[:-1]
        + b', "numbers": [1.0, 1e2, -0, 1E+2, 0.10, 12345678901234567890]}'
    )
    yield Case(
        "number-literals",
        ACCEPT,
        gz(tar(entries_of(signed(world, {**base, "data.json": literal})))),
    )
    unicode_raw = (
        base["data.json"].rstrip()[:-1]
        + b', "s": "\\u2028 \\u0007 \\/ <&> \\ud83d\\ude00 \xc3\xa9"}'
    )
    yield Case(
        "string-escapes",
        ACCEPT,
        gz(tar(entries_of(signed(world, {**base, "data.json": unicode_raw})))),
    )
    all_signed = signed(world, base)
    yield Case("legacy-nul-typeflag", ACCEPT, gz(tar(entries_of(all_signed, typeflag=b"\0"))))
    yield Case("gnu-magic", ACCEPT, gz(tar(entries_of(all_signed, magic=GNU))))
    yield Case("v7-no-magic", ACCEPT, gz(tar(entries_of(all_signed, magic=b""))))
    yield Case("extra-end-blocks", ACCEPT, gz(tar(entries_of(all_signed), end=bytes(8 * 512))))
    yield Case(
        "bytes-after-end-marker", ACCEPT, gz(tar(entries_of(all_signed), trailing=b"junk" * 200))
    )
    archive = tar(entries_of(all_signed))
    yield Case("two-gzip-members", ACCEPT, gz(archive[:1024]) + gz(archive[1024:]))
    scoped = pyjwt_signed(world, base, extra_payload={"scope": "write"})
    yield Case("scope-configured", ACCEPT, gz(tar(entries_of(scoped))), scope="write")
    with_extra = signed(world, {**base, "broker/key_policies/extra.rego": EXTRA_REGO})
    yield Case("signed-extra-module", ACCEPT, gz(tar(entries_of(with_extra))))


ODD_DATA: list[Any] = [
    "line\u2028separator\u2029",
    "\x00\x01\x1f\x7f control",
    "<script>&amp;</script>",
    {"b": 1, "a": [True, False, None], "é": {"ü": "ß"}, "": ""},
    ["\ud7ff", "\ue000", "\U0001f600", '"quoted"', "back\\slash", "tab\tnew\nline"],
    12345678901234567890,
    -0.5,
]


def tampered_cases(world: World) -> Iterator[Case]:
    base = world.files
    good = signed(world, base)
    yield Case("unsigned", REFUSE, opa_bundle.pack(base))
    yield Case("signed-by-another-key", REFUSE, opa_bundle.pack(signed(world, base, world.other)))
    yield Case("ecdsa-bundle-rsa-key", REFUSE, opa_bundle.pack(signed(world, base, world.ec)))
    for name in sorted(base):
        content = bytearray(base[name])
        if name.endswith(".json") or name == opa_bundle.MANIFEST:
            changed = _changed_json(bytes(content))
        else:
            content[len(content) // 2] ^= 1
            changed = bytes(content)
        yield Case(f"tampered-{name}", REFUSE, gz(tar(entries_of({**good, name: changed}))))
        without = {n: c for n, c in good.items() if n != name}
        yield Case(f"missing-{name}", REFUSE, gz(tar(entries_of(without))))
    yield Case(
        "wasm-swapped-for-allow-all",
        REFUSE,
        gz(tar(entries_of({**good, "policy.wasm": world.allow_all_wasm}))),
    )
    for extra in ("broker/key_policies/extra.rego", "extra.rego", "policy.wasm.bak"):
        added = {**good, extra: EXTRA_REGO}
        yield Case(f"unsigned-extra-{extra}", REFUSE, gz(tar(entries_of(added))))
    entries = entries_of(good)
    yield Case("duplicate-identical", REFUSE, gz(tar([*entries, entries[0]])))
    wasm_again = Entry(b"policy.wasm", world.allow_all_wasm)
    yield Case("duplicate-policy-wasm", REFUSE, gz(tar([*entries, wasm_again])))
    yield Case("duplicate-first", REFUSE, gz(tar([wasm_again, *entries])))
    yield from _signature_cases(world)
    archive = tar(entries)
    yield Case("truncated-archive", REFUSE, gz(archive[: len(archive) // 2]))
    yield Case("truncated-gzip", REFUSE, gz(archive)[:-40])
    broken = [
        Entry(e.name, e.content, checksum_delta=1 if i == 1 else 0) for i, e in enumerate(entries)
    ]
    yield Case("bad-header-checksum", REFUSE, gz(tar(broken)))
    yield Case("not-gzip", REFUSE, archive)
    lone_zero = archive[:512] + bytes(512) + archive[512:]
    yield Case("single-zero-block-inside", REFUSE, gz(lone_zero))


def _changed_json(content: bytes) -> bytes:
    value = json.loads(content)
    value["tampered"] = True
    return json.dumps(value).encode()


def _signature_cases(world: World) -> Iterator[Case]:
    base = world.files
    yield Case("two-signatures", REFUSE, gz(tar(entries_of(pyjwt_signed(world, base, tokens=2)))))
    yield Case("no-signature", REFUSE, gz(tar(entries_of(pyjwt_signed(world, base, tokens=0)))))
    yield Case("plugin-named", REFUSE, gz(tar(entries_of(pyjwt_signed(world, base, plugin="x")))))
    scoped = pyjwt_signed(world, base, extra_payload={"scope": "write"})
    yield Case("scope-not-configured", REFUSE, gz(tar(entries_of(scoped))))
    yield Case("scope-mismatch", REFUSE, gz(tar(entries_of(scoped))), scope="read")
    partial = sorted(base)[1:]
    missing_listing = pyjwt_signed(world, base, listed=partial)
    yield Case("file-not-listed", REFUSE, gz(tar(entries_of(missing_listing))))
    ghost = pyjwt_signed(world, base, listed=[*sorted(base), "ghost.rego"])
    yield Case("listed-file-absent", REFUSE, gz(tar(entries_of(ghost))))
    garbage = {**base, opa_bundle.SIGNATURES: b'{"signatures": ["a.b.c"]}'}
    yield Case("garbage-jws", REFUSE, gz(tar(entries_of(garbage))))
    not_json = {**base, opa_bundle.SIGNATURES: b"{not json"}
    yield Case("signatures-not-json", REFUSE, gz(tar(entries_of(not_json))))


def stricter_cases(world: World) -> Iterator[Case]:
    good = signed(world, world.files)
    entries = entries_of(good)
    # the attack that started this: an extra entry OPA skips, Python's tarfile read as a file
    for typeflag in (b"7", b"1", b"2", b"3", b"4", b"5", b"6", b"S", b"D", b"V", b"M"):
        content = world.allow_all_wasm if typeflag in (b"7", b"S") else b""
        name = b"policy.wasm" if typeflag not in (b"5", b"D") else b"policy.wasm/"
        odd = Entry(name, content, typeflag=typeflag, linkname=b"data.json")
        label = typeflag.decode()
        verdict = ACCEPT if typeflag == b"5" else STRICTER  # an empty directory entry: skipped
        yield Case(f"type-{label}-appended", verdict, gz(tar([*entries, odd])))
        yield Case(f"type-{label}-first", verdict, gz(tar([odd, *entries])))
    global_pax = Entry(b"pax_global_header", pax_record("path", "policy.wasm"), typeflag=b"g")
    yield Case("pax-global-header", STRICTER, gz(tar([global_pax, *entries])))
    long_name = "broker/key_policies/" + "l" * 90 + ".rego"
    with_long = signed(world, {**world.files, long_name: EXTRA_REGO})
    gnu_long = Entry(b"././@LongLink", long_name.encode() + b"\0", typeflag=b"L", magic=GNU)
    body = [e for e in entries_of(with_long) if e.name != long_name.encode()]
    yield Case(
        "gnu-long-name",
        STRICTER,
        gz(tar([*body, gnu_long, Entry(b"truncated-name", EXTRA_REGO, magic=GNU)])),
    )
    pax = Entry(b"PaxHeaders/x", pax_record("path", long_name), typeflag=b"x")
    yield Case("pax-long-name", STRICTER, gz(tar([*body, pax, Entry(b"short.rego", EXTRA_REGO)])))
    yield Case(
        "ustar-prefix-field",
        STRICTER,
        gz(tar([*body, Entry(long_name[-100:].encode(), EXTRA_REGO, prefix=b"broker")])),
    )
    as_opa_writes = signed(world, {**world.files, ".manifest": rooted_manifest(world.files)})
    yield Case(
        "rooted-names-as-opa-writes", ACCEPT, gz(tar(entries_of(good_rooted(as_opa_writes))))
    )
    absent_module = {**world.files, ".manifest": rooted_manifest(world.files, "/x.wasm")}
    yield Case(
        "manifest-names-absent-module", REFUSE, gz(tar(entries_of(signed(world, absent_module))))
    )
    # one file under two names OPA's path rules join: the broker refuses both
    allow_all = Entry(b"/policy.wasm", world.allow_all_wasm)
    yield Case("rooted-and-plain-policy-wasm", STRICTER, gz(tar([*entries, allow_all])))
    dotted = Entry(b"./policy.wasm", world.allow_all_wasm)
    yield Case("dotted-and-plain-policy-wasm", STRICTER, gz(tar([dotted, *entries])))
    # a directory entry with a size: Go's reader takes its "content" as the next header
    hidden = Entry(b"policy.wasm", world.allow_all_wasm).encode()
    smuggler = Entry(b"broker/", hidden[:BLOCK], typeflag=b"5")
    yield Case("directory-with-content", STRICTER, gz(tar([*entries, smuggler])))
    yield Case("directory-dot-dot", STRICTER, gz(tar([Entry(b"../", typeflag=b"5"), *entries])))
    yield Case("directory-no-slash", STRICTER, gz(tar([Entry(b"broker", typeflag=b"5"), *entries])))
    for odd_name in ("./policy.wasm", "a/../policy.wasm", "broker//x.rego", "broker\\x.rego"):
        files = signed(world, {**world.files, odd_name: EXTRA_REGO})
        yield Case(f"name-{odd_name}", STRICTER, gz(tar(entries_of(files))))
    for unloaded in ("README.md", "broker/data.json", "plan.json", "x/.signatures.json"):
        files = signed(world, {**world.files, unloaded: b"{}"})
        yield Case(f"unloaded-{unloaded}", STRICTER, gz(tar(entries_of(files))))
    md5 = pyjwt_signed(world, world.files, hash_algorithm="MD5")
    yield Case("md5-hashes", STRICTER, gz(tar(entries_of(md5))))
    yield Case("garbage-after-gzip", STRICTER, opa_bundle.pack(good) + b"garbage")
    # Go's reader takes the end of the data at a block boundary as the end of the archive
    yield Case("no-end-marker", STRICTER, gz(tar(entries, end=b"")))


def good_rooted(files: dict[str, bytes]) -> dict[str, bytes]:
    return {"/" + name: content for name, content in files.items()}


def rooted_manifest(files: dict[str, bytes], module: str = "/policy.wasm") -> bytes:
    """The manifest as ``opa build`` writes it for its ``/``-named entries."""
    manifest = json.loads(files[".manifest"])
    manifest["wasm"] = [{**manifest["wasm"][0], "module": module}]
    return json.dumps(manifest).encode()


def opa_made_cases(world: World, opa_made: OpaMade) -> Iterator[Case]:
    """Bundles made with OPA's own tools, as docs/policy.md tells a team to make them.

    ``opa sign`` + ``tar czf b.tar.gz .`` names every entry ``./…`` after a ``./`` directory
    entry, while ``opa sign`` lists the files without ``./``: OPA 1.22's own verifier compares
    the two raw names and refuses what its tools made (and its manifest's ``/policy.wasm`` no
    longer names ``./policy.wasm``). The broker takes the ``./`` off as it takes ``opa build``'s
    ``/`` off; its oracle is OPA on the same files named as ``opa build`` names them.
    """
    yield Case("opa-build-signing-key", ACCEPT, opa_made.built)
    yield Case("opa-sign-and-tar-of-dot", ACCEPT, opa_made.tarred, oracle=opa_made.tarred_plain)


def all_cases(world: World, opa_made: OpaMade) -> list[Case]:
    return [
        *valid_cases(world),
        *tampered_cases(world),
        *stricter_cases(world),
        *opa_made_cases(world, opa_made),
    ]


@dataclass
class Verdicts:
    case: Case
    opa_accepts: bool
    opa_output: str
    opa_loaded: tuple[bytes, Any] | None
    broker_accepts: bool
    broker_message: str
    broker_loaded: tuple[bytes, Any] | None


def run_opa(world_dir: Path, case: Case, index: int) -> tuple[bool, str, tuple[bytes, Any] | None]:
    bundle = world_dir / f"case-{index}.tar.gz"
    bundle.write_bytes(case.raw if case.oracle is None else case.oracle)
    output = world_dir / f"out-{index}.tar.gz"
    key = world_dir / f"{case.key}.pem"
    done = subprocess.run(
        [
            str(find_opa()), "build", "-b", str(bundle), "--verification-key", str(key),
            "--signing-alg", "ES256" if case.key == "ec" else "RS256",
            *(["--scope", case.scope] if case.scope else []),
            "-o", str(output),
        ],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        return False, (done.stderr + done.stdout).strip(), None
    return True, "", loaded_by_opa(output.read_bytes())


def loaded_by_opa(output: bytes) -> tuple[bytes, Any]:
    wasm, data = b"", {}
    with tarfile.open(fileobj=io.BytesIO(output), mode="r:gz") as archive:
        for member in archive.getmembers():
            extracted = archive.extractfile(member) if member.isreg() else None
            if extracted is None:
                continue
            if member.name.endswith("/policy.wasm"):
                wasm = extracted.read()
            elif member.name == "/data.json":
                data = json.loads(extracted.read())
    return wasm, data


def run_broker(world: World, case: Case) -> tuple[bool, str, tuple[bytes, Any] | None]:
    key = {"rsa": world.rsa, "ec": world.ec}[case.key].public_key()
    verification = opa_bundle.BundleVerification(key, scope=case.scope)
    try:
        verified = opa_bundle.read_bundle(case.raw, source="case", verification=verification)
    except PolicyLoadError as exc:
        return False, exc.message, None
    return True, "", (verified.wasm, dict(verified.data))


@pytest.fixture(scope="module")
def verdicts(
    world: World, opa_made: OpaMade, tmp_path_factory: pytest.TempPathFactory
) -> list[Verdicts]:
    directory = tmp_path_factory.mktemp("bundles")
    (directory / "rsa.pem").write_bytes(public_pem(world.rsa))
    (directory / "ec.pem").write_bytes(public_pem(world.ec))
    cases = all_cases(world, opa_made)

    def judge(indexed: tuple[int, Case]) -> Verdicts:
        index, case = indexed
        opa = run_opa(directory, case, index)
        broker = run_broker(world, case)
        return Verdicts(case, *opa, *broker)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(judge, enumerate(cases)))


@pytest.mark.timeout(300)
def test_opa_and_the_broker_agree_on_generated_bundles(verdicts: list[Verdicts]) -> None:
    problems: list[str] = []
    for v in verdicts:
        name = v.case.name
        if not v.opa_accepts and v.broker_accepts:
            problems.append(f"{name}: OPA refused ({v.opa_output}) but the broker accepted")
        if v.broker_accepts and v.opa_loaded != v.broker_loaded:
            problems.append(f"{name}: OPA and the broker loaded different policy or data")
        if v.case.expected in (ACCEPT, REFUSE):
            want = v.case.expected == ACCEPT
            if v.opa_accepts != want:
                problems.append(f"{name}: OPA {'refused' if want else 'accepted'} ({v.opa_output})")
            if v.broker_accepts != want:
                problems.append(f"{name}: the broker disagreed ({v.broker_message})")
        if v.case.expected == STRICTER:
            if v.broker_accepts:
                problems.append(f"{name}: the broker accepted a bundle outside its rules")
            elif v.opa_accepts and not any(r in v.broker_message for r in STRICTER_RULES):
                problems.append(f"{name}: refused for an unexpected reason: {v.broker_message}")
    counts = summary(verdicts)
    print(f"\nbundle differential: {json.dumps(counts)}")
    assert not problems, "\n".join(problems)
    assert counts["bundles"] >= 100
    accepted = {v.case.name for v in verdicts if v.broker_accepts}
    assert {"opa-build-signing-key", "opa-sign-and-tar-of-dot"} <= accepted


def summary(verdicts: list[Verdicts]) -> dict[str, int]:
    return {
        "bundles": len(verdicts),
        "opa_refused": sum(not v.opa_accepts for v in verdicts),
        "broker_refused": sum(not v.broker_accepts for v in verdicts),
        "both_accepted": sum(v.opa_accepts and v.broker_accepts for v in verdicts),
        "only_the_broker_refused": sum(v.opa_accepts and not v.broker_accepts for v in verdicts),
    }


def test_contiguous_file_named_policy_wasm_is_refused(world: World) -> None:
    """The reported attack: a type-7 entry named policy.wasm (allow-all) appended to a genuinely
    signed bundle. OPA skips the entry; Python's tarfile read it as the module to load."""
    entries = entries_of(signed(world, world.files))
    attack = Entry(b"policy.wasm", world.allow_all_wasm, typeflag=b"7")
    raw = gz(tar([*entries, attack]))
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:gz") as archive:  # what used to load
        loaded = [m for m in archive.getmembers() if m.isfile() and m.name == "policy.wasm"]
    assert len(loaded) == 2  # Python's reader sees the attacker's module as a file
    verification = opa_bundle.BundleVerification(world.rsa.public_key())
    with pytest.raises(PolicyLoadError) as caught:
        opa_bundle.read_bundle(raw, source="attack", verification=verification)
    assert "contiguous file" in caught.value.message


def test_build_is_reproducible_and_names_no_temporary_path(tmp_path: Path) -> None:
    from broker.policy.build import build_bundle  # noqa: PLC0415

    key = tmp_path / "sign.pem"
    key.write_bytes(private_pem(ec.generate_private_key(ec.SECP256R1())))
    outputs = [tmp_path / "a.tar.gz", tmp_path / "b.tar.gz"]
    for output in outputs:
        build_bundle(
            SHIPPED, output, opa=find_opa(), signing_key=key, revision="c0ffee", scope="test",
            freshness=Freshness(version=7, expires=2_000_000_000),
        )  # fmt: skip
    first, second = (o.read_bytes() for o in outputs)
    assert first == second
    files = opa_bundle.unpack(first, source="built")
    assert sorted(files) == [
        ".manifest", ".signatures.json", "broker/attest.rego", "broker/identity.rego",
        "broker/kbs.rego", "broker/release.rego", "broker_internal/decision.rego", "data.json",
        "policy.wasm",
    ]  # fmt: skip
    assert json.loads(files[".manifest"])["revision"] == "c0ffee"
    with tarfile.open(fileobj=io.BytesIO(first), mode="r:gz") as archive:
        for member in archive.getmembers():
            assert (member.mtime, member.uid, member.gid, member.uname) == (0, 0, 0, "")


def test_a_bundle_is_read_once(world: World, tmp_path: Path) -> None:
    """The bundle comes from a FIFO that can be read exactly once: a second reader (a check by
    one reader, a load by another) would find nothing and fail, or block."""
    import os  # noqa: PLC0415
    import threading  # noqa: PLC0415

    from broker.policy.build import load_bundle  # noqa: PLC0415

    (tmp_path / "verify.pem").write_bytes(public_pem(world.rsa))
    fifo = tmp_path / "bundle.tar.gz"
    os.mkfifo(fifo)
    raw = opa_bundle.pack(signed(world, world.files))

    def feed() -> None:
        with fifo.open("wb") as pipe:
            pipe.write(raw)

    writer = threading.Thread(target=feed)
    writer.start()
    loaded = load_bundle(fifo, opa=find_opa(), verification_key=tmp_path / "verify.pem")
    writer.join(timeout=10)
    assert loaded.wasm == world.files["policy.wasm"]
    assert loaded.digest == opa_bundle.files_digest(world.files)

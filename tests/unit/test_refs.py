"""Typed references (``broker/core/refs.py``): each configured store, KEK, signing key and bundle
string is parsed in one place, and no other module re-reads its prefix."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from broker.config import KeySettings
from broker.core.errors import ConfigError
from broker.core.refs import (
    KEK_FORMS,
    CloudKmsRef,
    GcsBundleRef,
    HttpBundleRef,
    LocalFileRef,
    MemoryRef,
    Pkcs11Ref,
    PostgresRef,
    RedisRef,
    SecretManagerRef,
    SqliteRef,
    bundle_ref,
    kek_ref,
    signer_ref,
    store_ref,
)
from broker.keys.factory import open_kek_ring, open_key_service
from broker.keys.kek.local import LocalKek, create_kek_file

BROKER = Path(__file__).resolve().parents[2] / "broker"
# Every scheme core/refs.py parses (test_the_guard_sees_every_form_refs_parses keeps it so).
SCHEMES = frozenset(
    {"cloudkms", "pkcs11", "local", "sqlite", "redis", "rediss", "postgres", "postgresql"}
    | {"secretmanager", "gs"}
)
# The only places outside core/refs.py that may read a scheme's prefix: (module, scheme) → why.
# Stale entries fail too, so the list only shrinks.
MAY_READ_PREFIX = {
    ("keys/kek/cloudkms.py", "cloudkms"): "the backend checks its own syntax: a CryptoKey name",
    ("cloud/kms_key.py", "cloudkms"): "the backend checks its own syntax: a CryptoKeyVersion",
    ("keys/kek/pkcs11.py", "pkcs11"): "the backend parses its own syntax: RFC 7512 attributes",
    ("keys/store/secretmanager.py", "secretmanager"): "the backend reads its project name",
    ("config/tables.py", "local"): "resolves the raw text's relative path, before the parse",
    ("config/tables.py", "sqlite"): "sqlite:///rel vs sqlite:////abs, which the parse erases",
    ("client/weights.py", "gs"): "a weights location given to the SDK, not a configured ref",
    ("cli/weights.py", "gs"): "a weights location on the command line, not a configured ref",
    ("cloud/storage_upload.py", "gs"): "the upload target of `weights encrypt gs://…`",
}
PREFIX_CALLS = frozenset({"startswith", "removeprefix", "find", "index", "rfind"})
REGEX_CALLS = frozenset({"match", "fullmatch", "search", "compile"})
SPLITS = frozenset({"partition", "rpartition", "split", "rsplit"})


def _prefix_scheme(text: str) -> str | None:
    """``sqlite`` for ``"sqlite:///"`` or ``r"^sqlite:"``; None for text that names no scheme."""
    head, colon, _ = text.lstrip("^").partition(":")
    return head if colon and head in SCHEMES else None


def _constants(tree: ast.Module) -> dict[str, str]:
    """Names bound to a scheme prefix (``PREFIX = "sqlite:///"``, ``self.prefix = …``)."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AnnAssign):
            targets = [node.target]
        value = getattr(node, "value", None)
        if targets and isinstance(value, ast.Constant) and isinstance(value.value, str):
            scheme = _prefix_scheme(value.value)
            for target in targets:
                name = getattr(target, "id", None) or getattr(target, "attr", None)
                if scheme and name:
                    bound[name] = scheme
    return bound


def _schemes(node: ast.AST, bound: dict[str, str], *, bare: bool = False) -> set[str]:
    """The schemes an operand stands for: a literal prefix, a name bound to one, ``len()`` of
    one, or a tuple of them; with ``bare``, also a scheme's bare name (``"postgres"``)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        scheme = _prefix_scheme(node.value) or (node.value if bare else None)
        return {scheme} if scheme in SCHEMES else set()
    if isinstance(node, ast.Name | ast.Attribute):
        name = node.id if isinstance(node, ast.Name) else node.attr
        return {bound[name]} if name in bound else set()
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return set().union(*(_schemes(e, bound, bare=bare) for e in node.elts))
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "len" and node.args:
        return _schemes(node.args[0], bound)
    return set()


def _is_scheme_part(node: ast.AST) -> bool:
    """``urlsplit(u).scheme``, a variable named ``scheme``, or ``u.partition(":")[0]``."""
    if isinstance(node, ast.Attribute | ast.Name):
        return (node.attr if isinstance(node, ast.Attribute) else node.id) == "scheme"
    return (
        isinstance(node, ast.Subscript)
        and isinstance(node.value, ast.Call)
        and getattr(node.value.func, "attr", None) in SPLITS
    )


def prefix_reads(source: str) -> list[tuple[int, str]]:
    """(line, scheme) of every place ``source`` reads a reference's form by its text: a prefix
    test or strip, a slice past one, a comparison with one, a regex that starts with one, or a
    URL's scheme compared with a scheme's name. Building a URI (``f"sqlite:///{path}"``), an
    error message or a default value is not a read."""
    tree = ast.parse(source)
    bound = _constants(tree)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        schemes: set[str] = set()
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            regex = node.func.attr in REGEX_CALLS and getattr(node.func.value, "id", "") == "re"
            if node.func.attr in PREFIX_CALLS or regex:
                schemes = _schemes(node.args[0], bound)
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            bare = any(_is_scheme_part(o) for o in operands)
            schemes = set().union(*(_schemes(o, bound, bare=bare) for o in operands))
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Slice):
            parts = (node.slice.lower, node.slice.upper)
            schemes = set().union(*(_schemes(p, bound) for p in parts if p is not None))
        if isinstance(node, ast.expr):
            found += [(node.lineno, scheme) for scheme in sorted(schemes)]
    return sorted(set(found))


@pytest.mark.parametrize(
    ("uri", "kind"),
    [
        ("memory", MemoryRef),
        ("sqlite:////var/lib/broker/nonces.db", SqliteRef),
        ("redis://cache:6379/0", RedisRef),
        ("rediss://cache:6380/0", RedisRef),
        ("postgresql://broker@db/broker", PostgresRef),
        ("postgres://broker@db/broker", PostgresRef),
        ("secretmanager:projects/p", SecretManagerRef),
    ],
)
def test_store_forms(uri: str, kind: type) -> None:
    ref = store_ref(uri, "nonces.store")
    assert isinstance(ref, kind)
    assert ref.uri == uri


def test_a_sqlite_store_names_its_absolute_path() -> None:
    ref = store_ref("sqlite:///var/lib/broker/nonces.db", "nonces.store")  # as resolved
    assert isinstance(ref, SqliteRef)
    assert ref.path == Path("/var/lib/broker/nonces.db")
    resolved_key_store = store_ref("sqlite:////var/lib/broker/keys.db", "keys.store")
    assert isinstance(resolved_key_store, SqliteRef)  # the factory opens this path as it is
    assert resolved_key_store.path == Path("/var/lib/broker/keys.db")  # not //var/lib/…


@pytest.mark.parametrize("uri", ["", "sqlite:///", "mysql://db/x", "memory:", "file:x"])
def test_malformed_store_names_its_setting(uri: str) -> None:
    with pytest.raises(ConfigError) as caught:
        store_ref(uri, "keys.store")
    assert caught.value.key == "keys.store"


def test_kek_forms() -> None:
    local = kek_ref("local:/srv/kek.key", "keys.kek")
    assert isinstance(local, LocalFileRef)
    assert local.path == Path("/srv/kek.key")
    assert isinstance(kek_ref("pkcs11:token=t;object=k", "keys.kek"), Pkcs11Ref)
    assert isinstance(
        kek_ref("cloudkms:projects/p/locations/l/keyRings/r/cryptoKeys/k", "k"), CloudKmsRef
    )
    for bad in ("local:", "vault:x", "kek.key"):
        with pytest.raises(ConfigError):
            kek_ref(bad, "keys.kek_previous[0]")


def test_signer_and_bundle_forms() -> None:
    assert isinstance(signer_ref("cloudkms:projects/p/x/cryptoKeyVersions/1"), CloudKmsRef)
    assert isinstance(signer_ref("pkcs11:token=t;object=r"), Pkcs11Ref)
    assert signer_ref("/etc/broker/log.pem") == LocalFileRef(
        "/etc/broker/log.pem", Path("/etc/broker/log.pem")
    )
    gcs = bundle_ref("gs://bucket/dir/prod.tar.gz")
    assert isinstance(gcs, GcsBundleRef)
    assert (gcs.bucket, gcs.name) == ("bucket", "dir/prod.tar.gz")
    assert isinstance(bundle_ref("https://bundles.internal/prod.tar.gz"), HttpBundleRef)


@pytest.mark.parametrize(
    ("kek", "previous", "kek_uri", "setting"),
    [
        ("vault:x", (), None, "keys.kek"),
        ("local:{k}", ("kek.key",), None, "keys.kek_previous[0]"),
        ("local:{k}", (), "vault:x", "keys.kek"),  # keys rewrap --to
    ],
)
async def test_a_malformed_kek_is_refused_before_the_store_opens(
    tmp_path: Path, kek: str, previous: tuple[str, ...], kek_uri: str | None, setting: str
) -> None:
    store = tmp_path / "keys.db"
    settings = KeySettings(
        store=f"sqlite:///{store}", kek=kek.format(k=tmp_path / "k"), kek_previous=previous
    )
    with pytest.raises(ConfigError) as caught:
        async with open_key_service(settings, create_missing_kek=True, kek_uri=kek_uri):
            pass
    assert caught.value.message == f"config {setting}: {KEK_FORMS}"
    assert not store.exists()


async def test_the_kek_ring_opens_the_parsed_refs(tmp_path: Path) -> None:
    """kek first, then kek_previous; a KEK listed twice is opened once."""
    first, second = tmp_path / "first.key", tmp_path / "second.key"
    create_kek_file(first)
    create_kek_file(second)
    settings = KeySettings(kek=f"local:{first}", kek_previous=(f"local:{second}", f"local:{first}"))
    async with open_kek_ring(settings) as ring:
        assert ring.primary.reference == LocalKek(first).reference
        assert ring.for_ref(LocalKek(second).reference) is not ring.primary


def test_no_module_rereads_a_reference_prefix() -> None:
    """Matched on by type (``isinstance`` on a ``*Ref``), never by ``startswith("cloudkms:")``:
    a prefix read anywhere in ``broker/`` outside core/refs.py fails, unless ``MAY_READ_PREFIX``
    names that module and that scheme."""
    found, used = [], set()
    for path in sorted(BROKER.rglob("*.py")):
        relative = path.relative_to(BROKER).as_posix()
        if relative == "core/refs.py":
            continue
        lines = path.read_text().splitlines()
        for number, scheme in prefix_reads(path.read_text()):
            if (relative, scheme) in MAY_READ_PREFIX:
                used.add((relative, scheme))
            else:
                found.append(f"{relative}:{number}: [{scheme}] {lines[number - 1].strip()}")
    assert not found, "parse it once in core/refs.py and match on the type:\n" + "\n".join(found)
    assert used == set(MAY_READ_PREFIX), f"no longer needed: {set(MAY_READ_PREFIX) - used}"


def test_the_guard_sees_every_form_refs_parses() -> None:
    """The guard reads core/refs.py's own prefix tests as reads, every one of ``SCHEMES``: a form
    added there without a line here, or a way of reading a prefix the guard misses, fails."""
    found = {scheme for _, scheme in prefix_reads((BROKER / "core" / "refs.py").read_text())}
    assert found == SCHEMES


@pytest.mark.parametrize(
    "line",
    [
        'ok = uri.startswith("cloudkms:")',
        'ok = uri.startswith(("redis://", "rediss://"))',
        'PREFIX = "sqlite:///"\nok = uri.startswith(PREFIX)',
        'KMS = "cloudkms:"\nname = uri.removeprefix(KMS)',
        'ok = uri[:7] == "pkcs11:"',
        'rest = uri[len("pkcs11:") :]',
        'ok = "gs://" in url',
        'ok = urlsplit(uri).scheme in ("postgresql", "postgres")',
        'ok = uri.partition(":")[0] == "local"',
        'ok = re.match(r"^secretmanager:projects/", uri)',
    ],
)
def test_a_new_prefix_read_is_caught(line: str) -> None:
    assert prefix_reads(line)


@pytest.mark.parametrize(
    "line",
    [
        'uri = f"sqlite:///{path}"',
        'raise ConfigError("keys.kek", "expected local:PATH, pkcs11:… or cloudkms:projects/…")',
        'store: str = "sqlite:////var/lib/broker/keys.db"',
        "ok = isinstance(ref, SqliteRef)",
        'ok = url.startswith("https://")',
        'ok = ref.kind == "postgresql"',
    ],
)
def test_writing_a_uri_is_not_a_read(line: str) -> None:
    assert not prefix_reads(line)

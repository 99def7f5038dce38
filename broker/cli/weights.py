"""``broker weights encrypt | decrypt | inspect``: the model owner's side of the data path.

``encrypt`` takes the DEK of an enabled model-weights key version straight from the key store
(the owner runs it with the broker's config; the use is logged as a ``key_admin`` record with
action ``weights-encrypt`` before any byte is encrypted) and writes BRKW1 files
(docs/weights-format.md): one file, or a whole directory such as a Hugging Face snapshot, with
``manifest.json``. Segments are encrypted on a thread pool (AES-GCM releases the GIL) while
the file is read once, in order; memory stays at ``2 * workers`` segments whatever the size.
``OUT`` may be ``gs://bucket/object`` (or a prefix for a directory): encrypted locally, then
uploaded (``cloud/storage_upload.py``). ``decrypt`` is for the owner's own checks (same
logging, digests compared with the manifest); ``inspect`` reads a header and needs no key.

``encrypt --url URL`` is for a sealed broker, whose KEK answers only the attested broker: the
owner's machine makes a fresh AES-256 DEK, imports it into the broker as a new version of
``--key`` (``POST /v1/admin/keys/import``, ``admin_remote.py``; with ``--broker-image`` only
after the broker's attestation is verified, over its attested certificate, so the TLS session
ends inside the TEE), and only once the broker has named the version encrypts with that DEK
and version, then zeroes its copy. Nothing is encrypted with a DEK the broker did not take.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tqdm import tqdm

from broker.audit.log import DecisionLog
from broker.cli.admin_remote import (
    BrokerRefused,
    add_remote_arguments,
    check_remote,
    import_new_dek,
    refuse_remote_flags,
    wipe,
)
from broker.client.weights import decrypt_to, open_source, read_sealed
from broker.cloud.storage_upload import split_gs_uri, storage_client, upload
from broker.config import load_settings
from broker.core.errors import ConfigError, FileFormatError, InputError
from broker.crypto.weights import (
    DEFAULT_SEGMENT,
    MAX_SEGMENT,
    PREFIX_BYTES,
    SALT_BYTES,
    SealedFile,
    WeightsFormatError,
    encode_header,
    file_key,
    segment_nonce,
)
from broker.crypto.wrap import key_id
from broker.keys import admin
from broker.keys.admin import cli_actor
from broker.keys.factory import open_key_service
from broker.keys.store.base import Purpose

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf")
SEALED_SUFFIX = ".brkw"
MANIFEST = "manifest.json"
EXIT_NO = 1
Advance = Callable[[int], object]
# (the files to encrypt, their total size) -> (kid, the DEK): called once the input is checked
KeySource = Callable[[list[Path], int], tuple[str, bytearray]]


def add_commands(weights: Any) -> None:
    encrypt = weights.add_parser("encrypt", help="encrypt a weights file or a model directory")
    encrypt.add_argument("source", type=Path, metavar="IN")
    encrypt.add_argument(
        "target",
        metavar="OUT",
        help="a file or a directory; gs://BUCKET/NAME uploads (the [gcs] extra)",
    )
    encrypt.add_argument("--key", required=True)
    encrypt.add_argument(
        "--version", type=int, help="default: the newest enabled version (not with --url)"
    )
    encrypt.add_argument(
        "--config",
        type=Path,
        help="the broker's configuration file (broker.toml): the DEK from its key store; or --url",
    )
    encrypt.add_argument("--segment-size", type=int, default=DEFAULT_SEGMENT)
    encrypt.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    add_remote_arguments(encrypt)  # --url: a new DEK made here, imported into the broker
    encrypt.set_defaults(run=_encrypt)
    decrypt = weights.add_parser("decrypt", help="decrypt (the owner's check)")
    decrypt.add_argument("source", type=Path, metavar="IN", help="a .brkw file or a directory")
    decrypt.add_argument("target", type=Path, metavar="OUT")
    decrypt.add_argument("--config", type=Path, required=True)
    decrypt.set_defaults(run=_decrypt)
    inspect = weights.add_parser(
        "inspect", help="a file's header, or a directory's manifest and headers (no key needed)"
    )
    inspect.add_argument("file", type=Path, metavar="FILE-or-DIR")
    inspect.set_defaults(run=_inspect)


# --- encrypt -------------------------------------------------------------------------------


def encrypt_file(
    dek: bytes | bytearray,
    kid: str,
    source: Path,
    target: Path,
    *,
    segment_size: int,
    pool: ThreadPoolExecutor,
    window: int,
    advance: Advance,
) -> dict[str, Any]:
    """Encrypt one file (read once, in order; segments sealed on ``pool``); return its
    manifest entry. The target appears only complete (``<target>.partial`` renamed)."""
    partial = target.with_name(target.name + ".partial")
    pending: deque[Future[bytes]] = deque()
    try:
        entry = _seal_to(
            dek,
            kid,
            source,
            partial,
            segment_size=segment_size,
            pool=pool,
            window=window,
            advance=advance,
            pending=pending,
        )
        partial.replace(target)
    finally:  # after a failure or an interrupt: stop the work, leave no partial file
        for future in pending:
            future.cancel()  # a no-op for finished work
        partial.unlink(missing_ok=True)  # already renamed after a success
    return entry


def _seal_to(
    dek: bytes | bytearray,
    kid: str,
    source: Path,
    partial: Path,
    *,
    segment_size: int,
    pool: ThreadPoolExecutor,
    window: int,
    advance: Advance,
    pending: deque[Future[bytes]],
) -> dict[str, Any]:
    salt, prefix = os.urandom(SALT_BYTES), os.urandom(PREFIX_BYTES)
    header = encode_header(kid, salt, prefix, segment_size)
    aead = file_key(dek, salt, kid)
    size = source.stat().st_size
    count = max(1, -(-size // segment_size))
    digest = hashlib.sha256()
    with source.open("rb") as reader, partial.open("wb") as writer:
        os.chmod(partial, 0o600)
        writer.write(header)
        for index in range(count):
            chunk = reader.read(segment_size)
            last = index == count - 1
            if len(chunk) != segment_size and not last:
                raise InputError(f"{source} changed while it was being encrypted")
            digest.update(chunk)
            pending.append(
                pool.submit(aead.encrypt, segment_nonce(prefix, index, last), chunk, header)
            )
            while len(pending) > window or (last and pending):
                writer.write(pending.popleft().result())
            advance(len(chunk))
        if reader.read(1):
            raise InputError(f"{source} grew while it was being encrypted")
        writer.flush()
        os.fsync(writer.fileno())
    return {"size": size, "sha256": digest.hexdigest()}


def model_files(directory: Path) -> Iterator[Path]:
    for path in sorted(directory.rglob("*")):
        if path.is_file() and not path.name.endswith((SEALED_SUFFIX, ".partial")):
            yield path


def _encrypt(args: argparse.Namespace) -> int:
    """Encrypt to a path, or to ``gs://`` (encrypted locally, then uploaded)."""
    keys = _key_source(args)
    target = str(args.target)
    try:
        if not target.startswith("gs://"):
            print(json.dumps(_encrypt_to(args, Path(target), keys), indent=2))
            return 0
        split_gs_uri(target)
        client = storage_client()  # a missing [gcs] extra is said before the key is used
        with tempfile.TemporaryDirectory(prefix="broker-weights-") as tmp:
            name = "out" if args.source.is_dir() else target.rstrip("/").rsplit("/", 1)[-1]
            local = Path(tmp) / name
            result = _encrypt_to(args, local, keys)
            result["uploaded"] = upload(local, target, client=client)
    except BrokerRefused as exc:
        print(exc, file=sys.stderr)
        return EXIT_NO
    print(json.dumps(result, indent=2))
    return 0


def _key_source(args: argparse.Namespace) -> KeySource:
    """Where the DEK comes from: the broker's key store (``--config``), or a new one made here
    and imported into the broker at ``--url``. The usage checks run here, before any work.

    Raises:
        ConfigError: flags that do not go together.
    """
    if args.url is None:
        refuse_remote_flags(args, "the DEK comes from the configured key store")
        return lambda plan, total: _stored_dek(args, plan, total)
    check_remote(args)
    if args.version is not None:
        raise ConfigError("--version", "the broker numbers an imported version; not with --url")
    if not args.broker_image:
        print(
            "warning: no --broker-image: the broker's attestation is not checked, and the new "
            "DEK goes to whichever server --ca (or the system's CAs) vouches for",
            file=sys.stderr,
        )
    name = admin.key_name(args.key)

    def imported(plan: list[Path], total: int) -> tuple[str, bytearray]:
        version, dek = import_new_dek(args, name, Purpose.MODEL_WEIGHTS)
        return key_id(name, version), dek

    return imported


def _stored_dek(args: argparse.Namespace, plan: list[Path], total: int) -> tuple[str, bytearray]:
    """The DEK of ``--key`` (``--version``) from the key store of ``--config``, its use logged
    as a ``key_admin`` ``weights-encrypt`` record first."""
    settings = load_settings(args.config)

    async def dek() -> tuple[str, bytes]:
        audit = DecisionLog(settings.audit.log, replica=settings.server.replica_id)
        await audit.open()
        async with open_key_service(settings.keys, change_log=audit.append_entry) as keys:
            try:
                detail = {"files": len(plan), "bytes": total, "source": str(args.source)}
                record, material = await keys.owner_material(
                    args.key,
                    args.version,
                    action="weights-encrypt",
                    detail=detail,
                    now=datetime.now(UTC),
                    who=cli_actor(),
                )
            finally:
                await audit.close()
            return key_id(record.name, record.version), material

    kid, material = asyncio.run(dek())
    return kid, bytearray(material)


def _encrypt_to(args: argparse.Namespace, out: Path, keys: KeySource) -> dict[str, Any]:
    """Encrypt ``args.source`` to ``out`` (a file, or a directory); the kid and entries. The
    key is asked for once the input is checked, and nothing is written before it is known."""
    if not 1 <= args.segment_size <= MAX_SEGMENT:
        raise InputError(f"--segment-size must be 1..{MAX_SEGMENT}")
    fix = "name a weights file or a model directory (*.safetensors, *.bin, *.gguf)"
    if not args.source.exists():
        raise FileFormatError(args.source, "no such file or directory", fix)
    if args.source.is_dir():
        plan = [p for p in model_files(args.source) if p.name.endswith(WEIGHT_SUFFIXES)]
        if not plan:
            raise FileFormatError(args.source, "holds no weights files", fix)
    else:
        plan = [args.source]
    total = sum(p.stat().st_size for p in plan)
    kid, material = keys(plan, total)
    try:
        return _encrypt_plan(args, out, plan=plan, total=total, kid=kid, material=material)
    finally:
        wipe(material)


def _encrypt_plan(
    args: argparse.Namespace,
    out: Path,
    *,
    plan: list[Path],
    total: int,
    kid: str,
    material: bytearray,
) -> dict[str, Any]:
    if args.source.is_dir():
        out.mkdir(parents=True, exist_ok=True)
    entries = []
    with (
        ThreadPoolExecutor(max_workers=max(1, args.workers)) as pool,
        tqdm(total=total, unit="B", unit_scale=True, disable=not sys.stderr.isatty()) as bar,
    ):
        for path in plan:
            if args.source.is_dir():
                relative = path.relative_to(args.source).as_posix()
                target = out / (relative + SEALED_SUFFIX)
                target.parent.mkdir(parents=True, exist_ok=True)
            else:
                relative = path.name
                target = out
            entry = encrypt_file(
                material,
                kid,
                path,
                target,
                segment_size=args.segment_size,
                pool=pool,
                window=2 * max(1, args.workers),
                advance=bar.update,
            )
            entries.append(
                {
                    "path": relative,
                    "encrypted": target.name
                    if not args.source.is_dir()
                    else relative + SEALED_SUFFIX,
                    **entry,
                }
            )
    if args.source.is_dir():
        for other in model_files(args.source):
            if other not in plan:  # configs, tokenizers: not secret, copied as they are
                copy = out / other.relative_to(args.source)
                copy.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(other, copy)
        manifest = {
            "format": "BRKW1",
            "kid": kid,
            "segment_size": args.segment_size,
            "files": entries,
        }
        (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return {"kid": kid, "files": entries}


# --- decrypt -------------------------------------------------------------------------------


def _decrypt(args: argparse.Namespace) -> int:
    if args.source.is_dir():
        manifest = _manifest(args.source)
        try:
            jobs = [
                (args.source / e["encrypted"], args.target / e["path"], e.get("sha256"))
                for e in manifest["files"]
            ]
            kid = str(manifest["kid"])
        except (KeyError, TypeError) as exc:
            raise FileFormatError(args.source / MANIFEST, "not a manifest", NOT_WEIGHTS) from exc
    else:
        jobs = [(args.source, args.target, None)]
        kid = _header_of(args.source)["kid"]
    name, _, version = kid.rpartition("#")
    if not name or not version.isdigit():
        raise InputError(f"key id {kid!r} is not <key>#<version>")
    settings = load_settings(args.config)

    async def run() -> list[dict[str, Any]]:
        audit = DecisionLog(settings.audit.log, replica=settings.server.replica_id)
        await audit.open()
        async with open_key_service(settings.keys, change_log=audit.append_entry) as keys:
            try:
                detail = {"files": len(jobs), "source": str(args.source)}
                who = cli_actor()
                _, material = await keys.owner_material(
                    name,
                    int(version),
                    action="weights-decrypt",
                    detail=detail,
                    now=datetime.now(UTC),
                    who=who,
                )
                outcome: dict[str, Any] = {"key": name, "version": int(version), **detail}
                try:
                    results = await _decrypt_jobs(jobs, material, kid)
                except (WeightsFormatError, OSError) as exc:
                    outcome |= {"outcome": "failed", "problem": str(exc)[:512]}
                    raise
                else:
                    outcome |= {
                        "outcome": "ok",
                        "bytes": sum(int(r["size"]) for r in results),
                        "sha256": [r["sha256"] for r in results],
                    }
                finally:
                    # the record of how it ended, whatever happened (the first record, written
                    # before the key was used, says that it was)
                    await keys.log_outcome(
                        "weights-decrypt-result", outcome, now=datetime.now(UTC), who=who
                    )
            finally:
                await audit.close()
        return results

    try:
        results = asyncio.run(run())
    except WeightsFormatError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_NO
    if args.source.is_dir():  # configs and tokenizers too: the result is a loadable model
        results += _copy_plain_files(args.source, args.target)
    print(json.dumps(results, indent=2))
    return 0


def _copy_plain_files(source: Path, target: Path) -> list[dict[str, Any]]:
    """The directory's files that were never encrypted (everything but the manifest and the
    ``.brkw`` files), copied beside the decrypted weights."""
    copied = []
    for path in model_files(source):
        if path.name == MANIFEST and path.parent == source:
            continue
        copy = target / path.relative_to(source)
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, copy)
        copied.append({"path": str(copy), "size": copy.stat().st_size, "copied": True})
    return copied


async def _decrypt_jobs(
    jobs: list[tuple[Path, Path, str | None]], material: bytes, kid: str
) -> list[dict[str, Any]]:
    results = []
    for source, target, expected in jobs:
        target.parent.mkdir(parents=True, exist_ok=True)
        size = await decrypt_to(source, target, material, kid)
        actual = await asyncio.to_thread(_sha256, target)
        if expected is not None and actual != expected:
            raise WeightsFormatError(f"{target}: SHA-256 differs from the manifest")
        results.append({"path": str(target), "size": size, "sha256": actual})
    return results


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


# --- inspect -------------------------------------------------------------------------------


def _sealed_file(path: Path) -> SealedFile:
    source = open_source(path)
    try:
        return read_sealed(source)
    finally:
        source.close()


NOT_WEIGHTS = "name a .brkw file or a model directory `broker weights encrypt` wrote"


def _manifest(directory: Path) -> dict[str, Any]:
    """An encrypted model directory's manifest.

    Raises:
        FileFormatError: missing, unreadable or not a JSON object.
    """
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise FileFormatError(path, f"cannot read it ({exc.strerror})", NOT_WEIGHTS) from exc
    except ValueError as exc:
        raise FileFormatError(path, "not a manifest (not JSON)", NOT_WEIGHTS) from exc
    if not isinstance(manifest, dict):
        raise FileFormatError(path, "not a manifest", NOT_WEIGHTS)
    return manifest


def _inspect(args: argparse.Namespace) -> int:
    """One file's header; for a model directory, its manifest and every file's header.

    Raises:
        FileFormatError: a file that is not BRKW1, a directory without a valid manifest.
    """
    if not args.file.is_dir():
        print(json.dumps(_header_of(args.file), indent=2))
        return 0
    manifest = _manifest(args.file)
    try:
        files = [
            {"path": entry["path"], **_header_of(args.file / entry["encrypted"])}
            for entry in manifest["files"]
        ]
    except (KeyError, TypeError) as exc:
        raise FileFormatError(args.file / MANIFEST, "not a manifest", NOT_WEIGHTS) from exc
    print(json.dumps({"manifest": manifest, "files": files}, indent=2))
    return 0


def _header_of(path: Path) -> dict[str, Any]:
    try:
        sealed = _sealed_file(path)
        sealed.check()
    except WeightsFormatError as exc:
        raise FileFormatError(path, str(exc), NOT_WEIGHTS) from exc
    header = sealed.header
    return {
        "format": "BRKW1",
        "kid": header.kid,
        "segment_size": header.segment_size,
        "segments": sealed.segments,
        "plaintext_size": sealed.plaintext_size,
        "encrypted_size": sealed.size,
        "salt": header.salt.hex(),
        "nonce_prefix": header.prefix.hex(),
    }

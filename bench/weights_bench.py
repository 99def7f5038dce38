"""Weights encryption and decryption: BRKW1 against raw AES-GCM and Tink, in the same run.

    .venv/bin/python bench/weights_bench.py            # 1 GiB; --mib 256 for a quick look

In memory (a 1 GiB buffer): BRKW1 segments sealed/opened on a thread pool (as `broker weights`
and `decrypt_to` do), raw AES-256-GCM over the same 1 MiB segments on the same pool (the floor:
no key derivation, nonce construction or AAD), and Tink's streaming AEAD
(AES256_GCM_HKDF_1MB, the nearest off-the-shelf format). Targets: BRKW1 decrypt >= 2x Tink and
>= 80 % of raw AES-GCM. On disk (a 1 GiB file under $TMPDIR): `broker weights encrypt`'s
encrypt_file and the SDK's decrypt_to, each in a child process whose peak RSS is reported
(target: under 100 MiB). Through the public SDK (``open_encrypted(…).read()``, ``decrypt_to`` on
tmpfs) against floors measured in the same run (``sdk_public``). Prints one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from broker.cli.weights import encrypt_file
from broker.client.weights import decrypt_to
from broker.crypto.weights import (
    DEFAULT_SEGMENT,
    TAG_BYTES,
    Header,
    SealedFile,
    SegmentCipher,
    encode_header,
    file_key,
    segment_nonce,
)

DEK = bytes(range(32))
KID = "models/bench#1"
SEGMENT = DEFAULT_SEGMENT
WORKERS = os.cpu_count() or 1


def gbps(size: int, seconds: float) -> float:
    return round(size / seconds / 1e9, 2)


def touched(size: int) -> bytearray:
    """A buffer whose pages are already mapped: timings measure the cipher, not page faults
    (a runner decrypting into memory pays those once, whatever the cipher)."""
    buffer = bytearray(size)
    buffer[::4096] = b"\1" * len(range(0, size, 4096))
    return buffer


def brkw_memory(data: bytes, pool: ThreadPoolExecutor) -> tuple[float, float]:
    """(encrypt s, decrypt s): BRKW1 segment by segment on ``pool``, into buffers."""
    salt, prefix = os.urandom(16), os.urandom(7)
    header = encode_header(KID, salt, prefix, SEGMENT)
    aead = file_key(DEK, salt, KID)
    view = memoryview(data)
    count = max(1, -(-len(data) // SEGMENT))
    full = SEGMENT + TAG_BYTES
    sealed = touched(len(header) + len(data) + TAG_BYTES * count)
    sealed[: len(header)] = header
    out = memoryview(sealed)

    def seal(i: int) -> None:
        chunk = view[i * SEGMENT : (i + 1) * SEGMENT]
        start = len(header) + i * full
        nonce = segment_nonce(prefix, i, i == count - 1)
        aead.encrypt_into(nonce, chunk, header, out[start : start + len(chunk) + TAG_BYTES])

    started = time.perf_counter()
    list(pool.map(seal, range(count)))
    encrypt_s = time.perf_counter() - started
    file = SealedFile(Header.parse(bytes(out[:200])), len(sealed))
    cipher = SegmentCipher(DEK, file, KID)
    plain = touched(len(data))
    target = memoryview(plain)

    def open_(i: int) -> None:
        start, length = file.span(i)
        cipher.open_into(i, out[start : start + length], target[i * SEGMENT :])

    started = time.perf_counter()
    list(pool.map(open_, range(count)))
    decrypt_s = time.perf_counter() - started
    assert plain == data
    return encrypt_s, decrypt_s


def raw_memory(data: bytes, pool: ThreadPoolExecutor) -> tuple[float, float]:
    """The floor: AES-256-GCM over the same segments, same pool, no derivation and no AAD."""
    aead = AESGCM(DEK)
    view = memoryview(data)
    count = -(-len(data) // SEGMENT)
    full = SEGMENT + TAG_BYTES
    nonces = [i.to_bytes(12, "big") for i in range(count)]
    sealed = memoryview(touched(len(data) + TAG_BYTES * count))

    def seal(i: int) -> None:
        chunk = view[i * SEGMENT : (i + 1) * SEGMENT]
        aead.encrypt_into(nonces[i], chunk, None, sealed[i * full : i * full + len(chunk) + 16])

    started = time.perf_counter()
    list(pool.map(seal, range(count)))
    encrypt_s = time.perf_counter() - started
    plain = memoryview(touched(len(data)))

    def open_(i: int) -> None:
        piece = sealed[i * full : min((i + 1) * full, len(sealed))]
        end = i * SEGMENT + len(piece) - TAG_BYTES
        aead.decrypt_into(nonces[i], piece, None, plain[i * SEGMENT : end])

    started = time.perf_counter()
    list(pool.map(open_, range(count)))
    return encrypt_s, time.perf_counter() - started


def tink_memory(data: bytes) -> tuple[float, float] | None:
    try:
        import tink  # noqa: PLC0415
        from tink import streaming_aead  # noqa: PLC0415
    except ImportError:
        return None
    streaming_aead.register()
    handle = tink.new_keyset_handle(streaming_aead.streaming_aead_key_templates.AES256_GCM_HKDF_1MB)
    primitive = handle.primitive(streaming_aead.StreamingAead)

    class Keep(io.BytesIO):
        def close(self) -> None:  # Tink closes its sink; keep the bytes
            pass

    sink = Keep()
    started = time.perf_counter()
    with primitive.new_encrypting_stream(sink, b"") as stream:
        stream.write(data)
    encrypt_s = time.perf_counter() - started
    plain = touched(len(data))
    sealed = io.BytesIO(sink.getvalue())
    started = time.perf_counter()
    with primitive.new_decrypting_stream(sealed, b"") as stream:
        view, done = memoryview(plain), 0
        while done < len(plain):
            got = stream.readinto(view[done:])
            if not got:
                break
            done += got
    decrypt_s = time.perf_counter() - started
    assert plain == data
    return encrypt_s, decrypt_s


def child(mode: str, source: str, target: str) -> None:
    """One on-disk run in this (fresh) process; prints seconds and peak RSS."""
    started = time.perf_counter()
    if mode == "copy":  # the disk's floor: read, write, fsync the same bytes
        with open(source, "rb") as reader, open(target, "wb") as writer:
            while chunk := reader.read(SEGMENT):
                writer.write(chunk)
            writer.flush()
            os.fsync(writer.fileno())
    elif mode == "encrypt":
        with ThreadPoolExecutor(max_workers=WORKERS) as pool:
            encrypt_file(
                DEK,
                KID,
                Path(source),
                Path(target),
                segment_size=SEGMENT,
                pool=pool,
                window=2 * WORKERS,
                advance=lambda _: None,
            )
    else:
        asyncio.run(decrypt_to(source, target, DEK, KID, parallelism=WORKERS))
    seconds = time.perf_counter() - started
    # VmHWM, not ru_maxrss: ru_maxrss survives execve, so a child forked from this 1 GiB
    # parent would report the parent's peak.
    status = Path("/proc/self/status").read_text()
    peak_kib = next(
        int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")
    )
    print(json.dumps({"seconds": seconds, "peak_rss_mib": round(peak_kib / 1024, 1)}))


def on_disk(size: int, directory: Path) -> dict[str, object]:
    plain, sealed, back = directory / "plain.bin", directory / "plain.brkw", directory / "back.bin"
    with plain.open("wb") as handle:
        for _ in range(size // SEGMENT):
            handle.write(os.urandom(SEGMENT))
    results: dict[str, object] = {}
    steps = (
        ("copy", plain, directory / "copy.bin"),
        ("encrypt", plain, sealed),
        ("decrypt", sealed, back),
    )
    for mode, src, dst in steps:
        done = subprocess.run(
            [sys.executable, __file__, "--child", mode, str(src), str(dst)],
            capture_output=True,
            text=True,
            check=True,
        )
        figures = json.loads(done.stdout)
        results[f"file_{mode}_gbps"] = gbps(size, figures["seconds"])
        results[f"file_{mode}_peak_rss_mib"] = figures["peak_rss_mib"]
    same = subprocess.run(["cmp", "-s", str(plain), str(back)], check=False).returncode == 0
    results["file_round_trip_identical"] = same
    return results


def sdk_public(data: bytes, directory: Path) -> dict[str, object]:
    """Through the public SDK functions exactly as docs/runner.md shows them, on tmpfs, against
    three floors measured in the same run: AES-256-GCM into an already-mapped buffer (the
    cipher alone), AES-256-GCM producing a fresh plaintext object (the cipher plus the memory a
    reader must map: ``aead.decrypt`` per segment, joined), and writing the plaintext to tmpfs
    (what ``decrypt_to`` must do anyway)."""
    from broker.client.weights import open_encrypted  # noqa: PLC0415
    from broker.crypto.weights import encrypt_stream  # noqa: PLC0415

    size = len(data)
    sealed, out = directory / "model.brkw", directory / "model.out"
    with sealed.open("wb") as sink:
        encrypt_stream(DEK, KID, io.BytesIO(data), sink)
    aead = AESGCM(DEK)
    nonce = bytes(12)
    chunks = [aead.encrypt(nonce, data[i : i + SEGMENT], None) for i in range(0, size, SEGMENT)]
    mapped = touched(size)
    view = memoryview(mapped)
    started = time.perf_counter()
    for i, chunk in enumerate(chunks):
        aead.decrypt_into(nonce, chunk, None, view[i * SEGMENT : i * SEGMENT + len(chunk) - 16])
    cipher_s = time.perf_counter() - started
    del mapped, view
    started = time.perf_counter()
    fresh = b"".join(aead.decrypt(nonce, chunk, None) for chunk in chunks)
    fresh_s = time.perf_counter() - started
    del fresh, chunks
    started = time.perf_counter()
    out.write_bytes(data)
    write_s = time.perf_counter() - started
    out.unlink()
    started = time.perf_counter()
    with open_encrypted(sealed, DEK, KID) as reader:
        got = reader.read()
    read_s = time.perf_counter() - started
    assert got == data
    del got
    started = time.perf_counter()
    asyncio.run(decrypt_to(sealed, out, DEK, KID))
    decrypt_to_s = time.perf_counter() - started
    out.unlink()
    sealed.unlink()
    return {
        "sdk_tmpfs_dir": str(directory),
        "floor_gcm_mapped_gbps": gbps(size, cipher_s),
        "floor_gcm_fresh_object_gbps": gbps(size, fresh_s),
        "floor_tmpfs_write_gbps": gbps(size, write_s),
        "sdk_open_encrypted_read_gbps": gbps(size, read_s),
        "sdk_open_encrypted_read_vs_gcm_fresh_object": round(fresh_s / read_s, 2),
        "sdk_open_encrypted_read_vs_gcm_mapped": round(cipher_s / read_s, 2),
        "sdk_decrypt_to_tmpfs_gbps": gbps(size, decrypt_to_s),
        "sdk_decrypt_to_vs_tmpfs_write": round(write_s / decrypt_to_s, 2),
        "sdk_decrypt_to_vs_gcm_mapped": round(cipher_s / decrypt_to_s, 2),
    }


def main(mib: int) -> int:
    size = mib * 2**20
    data = os.urandom(size)
    report: dict[str, object] = {"size_mib": mib, "segment": SEGMENT, "threads": WORKERS}
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        enc, dec = brkw_memory(data, pool)
        raw_enc, raw_dec = raw_memory(data, pool)
    report |= {
        "brkw_encrypt_gbps": gbps(size, enc),
        "brkw_decrypt_gbps": gbps(size, dec),
        "raw_gcm_encrypt_gbps": gbps(size, raw_enc),
        "raw_gcm_decrypt_gbps": gbps(size, raw_dec),
        "decrypt_vs_raw": round(raw_dec / dec, 2),
    }
    tink = tink_memory(data)
    if tink is not None:
        report |= {
            "tink_encrypt_gbps": gbps(size, tink[0]),
            "tink_decrypt_gbps": gbps(size, tink[1]),
            "decrypt_vs_tink": round(tink[1] / dec, 2),
        }
    shm = Path("/dev/shm")
    with tempfile.TemporaryDirectory(
        prefix="broker-weights-sdk-", dir=shm if shm.is_dir() else None
    ) as tmp:
        report |= sdk_public(data, Path(tmp))
    del data
    with tempfile.TemporaryDirectory(prefix="broker-weights-bench-") as tmp:
        report |= on_disk(size, Path(tmp))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], sys.argv[4])
        raise SystemExit(0)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mib", type=int, default=1024)
    raise SystemExit(main(parser.parse_args().mib))

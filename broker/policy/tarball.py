"""The strict tar reader and the reproducible writer of OPA bundles (``.tar.gz``).

Steps 1-3 of ``opa_bundle.read_bundle`` (see its checklist): gzip members whole and bounded,
tar headers checked by checksum, regular files and empty directory entries only, names with one
leading ``/`` or ``./`` taken off (as OPA's tools write them) and then relative, normalised and
unique. ``pack`` writes what ``broker policy build`` ships: sorted, regular files only, mode
0644, uid/gid 0, mtime 0, gzip without a time or a name.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping

from broker.policy.wasm import PolicyLoadError

MAX_BUNDLE_BYTES = 32 * 1024 * 1024
MAX_UNPACKED_BYTES = 64 * 1024 * 1024
MAX_ENTRIES = 1024
MAX_NAME_CHARS = 100  # the ustar name field; the prefix field must be empty
BLOCK = 512
ZERO_BLOCK = bytes(BLOCK)
REGULAR_TYPES = (b"0", b"\0")
DIRECTORY_TYPE = b"5"
DIRECTORY_ROOTS = ("", ".")  # "./" (tar of .) and "/" name the bundle's root
TYPE_NAMES = {
    b"1": "hard link",
    b"2": "symbolic link",
    b"3": "character device",
    b"4": "block device",
    b"5": "directory",
    b"6": "FIFO",
    b"7": "contiguous file",
    b"g": "PAX global header",
    b"x": "PAX extended header",
    b"L": "GNU long name",
    b"K": "GNU long link name",
    b"S": "GNU sparse file",
    b"D": "GNU directory dump",
    b"M": "GNU multi-volume",
    b"V": "GNU volume label",
}
FIXED_MTIME = 0  # builds are reproducible: no clock in the archive
FILE_MODE = 0o644


def unpack(raw: bytes, *, source: str) -> dict[str, bytes]:
    """Steps 1-3: the regular files of a ``.tar.gz``, by normalised name, in archive order.

    Raises:
        PolicyLoadError: any entry or byte outside the rules.
    """
    if len(raw) > MAX_BUNDLE_BYTES:
        raise PolicyLoadError(f"{source}: bundle exceeds {MAX_BUNDLE_BYTES} bytes")
    archive = _gunzip(raw, source)
    files: dict[str, bytes] = {}
    position = 0
    for _ in range(MAX_ENTRIES + 1):
        block = archive[position : position + BLOCK]
        if len(block) < BLOCK:
            raise PolicyLoadError(f"{source}: the archive is truncated (no end-of-archive blocks)")
        if block == ZERO_BLOCK:
            if archive[position + BLOCK : position + 2 * BLOCK] != ZERO_BLOCK:
                raise PolicyLoadError(f"{source}: a zero block not followed by another")
            return files  # what follows the end marker is not part of the archive
        name, size = _header(block, source)
        position += BLOCK
        if name is None:
            continue  # a directory entry (no content): OPA skips it too
        if name in files:
            raise PolicyLoadError(f"{source}: {name!r} appears twice in the archive")
        if len(files) >= MAX_ENTRIES:
            raise PolicyLoadError(f"{source}: more than {MAX_ENTRIES} entries")
        if position + size > len(archive):
            raise PolicyLoadError(f"{source}: {name!r} is truncated")
        files[name] = archive[position : position + size]
        position += -(-size // BLOCK) * BLOCK
    raise PolicyLoadError(f"{source}: more than {MAX_ENTRIES} entries")


def _gunzip(raw: bytes, source: str) -> bytes:
    out = bytearray()
    rest = raw
    while True:
        inflater = zlib.decompressobj(wbits=31)
        try:
            out += inflater.decompress(rest, MAX_UNPACKED_BYTES + 1 - len(out))
        except zlib.error as exc:
            raise PolicyLoadError(f"{source}: not a gzip-compressed bundle ({exc})") from exc
        if len(out) > MAX_UNPACKED_BYTES or inflater.unconsumed_tail:
            raise PolicyLoadError(f"{source}: bundle unpacks to more than {MAX_UNPACKED_BYTES}")
        if not inflater.eof:
            raise PolicyLoadError(f"{source}: the gzip stream is truncated")
        rest = inflater.unused_data
        if not rest:
            return bytes(out)


def _header(block: bytes, source: str) -> tuple[str | None, int]:
    """One header block: its checksum, type, normalised name and size (steps 2-3); the name is
    ``None`` for a directory entry (type ``5``, no content), which carries nothing to load."""
    stored = _octal(block[148:156], "checksum", source)
    unsigned = sum(block[:148]) + 8 * 32 + sum(block[156:])
    signed = sum(b - 256 if b > 127 else b for b in block[:148] + block[156:]) + 8 * 32
    if stored not in (unsigned, signed):
        raise PolicyLoadError(f"{source}: a tar header fails its checksum")
    raw_name = block[:100].split(b"\0", 1)[0]
    typeflag = block[156:157]
    shown = raw_name.decode("utf-8", "backslashreplace")
    kind = TYPE_NAMES.get(typeflag, f"type {typeflag!r}")
    directory = typeflag == DIRECTORY_TYPE
    if (typeflag not in REGULAR_TYPES and not directory) or raw_name.endswith(b"/") != directory:
        kind = "directory" if raw_name.endswith(b"/") else kind
        raise PolicyLoadError(
            f"{source}: entry {shown!r} is a {kind}; a bundle holds only regular files "
            "(and directory entries named with a trailing /)"
        )
    for field, (start, end) in {"mode": (100, 108), "uid": (108, 116), "gid": (116, 124)}.items():
        _octal(block[start:end], field, source)
    _octal(block[136:148], "mtime", source)
    if block[345:500].strip(b"\0"):
        raise PolicyLoadError(f"{source}: a tar header uses the name prefix field")
    size = _octal(block[124:136], "size", source)
    if directory:
        if size:  # Go's reader ignores a directory's size: its "content" would be read as headers
            raise PolicyLoadError(f"{source}: directory entry {shown!r} has content")
        name = _opa_name(raw_name[:-1], source)
        if name not in DIRECTORY_ROOTS:
            _entry_name(name, source)
        return None, 0
    return _entry_name(_opa_name(raw_name, source), source), size


def _opa_name(raw_name: bytes, source: str) -> str:
    """An entry's name with what OPA's tools put before it taken off: the one leading ``/`` of
    ``opa build``'s output, or the ``./`` of ``tar czf b.tar.gz .`` (``opa sign`` lists the
    files without it)."""
    try:
        name = raw_name.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PolicyLoadError(f"{source}: an entry name is not UTF-8") from exc
    for prefix in ("/", "./"):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def _octal(field: bytes, what: str, source: str) -> int:
    """A numeric header field as Go's archive/tar reads it: octal digits, padded with spaces or
    NULs (base-256 numbers are refused)."""
    text = field.strip(b" \0")
    if not text:
        return 0
    if not all(0x30 <= b <= 0x37 for b in text):
        raise PolicyLoadError(f"{source}: a tar header's {what} is not an octal number")
    return int(text, 8)


def _entry_name(name: str, source: str) -> str:
    parts = name.split("/")
    if (
        not name
        or name.startswith("/")
        or "\\" in name
        or not name.isprintable()
        or any(part in ("", ".", "..") for part in parts)
    ):
        raise PolicyLoadError(
            f"{source}: entry name {name!r} is not a relative, normalised path "
            "(no empty, . or .. component, no backslash; one leading / or ./ is taken off)"
        )
    return name


def pack(files: Mapping[str, bytes]) -> bytes:
    """A reproducible ``.tar.gz``: entries sorted by name, regular files only, mode 0644, uid and
    gid 0, mtime 0, no user names, and a gzip header without a time or file name.

    Raises:
        PolicyLoadError: for a name the reader would refuse.
    """
    blocks = bytearray()
    for name in sorted(files):
        encoded = _entry_name(name, "bundle").encode("utf-8")
        if len(encoded) > MAX_NAME_CHARS:
            raise PolicyLoadError(f"bundle entry name {name!r} exceeds {MAX_NAME_CHARS} bytes")
        content = files[name]
        blocks += _ustar_header(encoded, len(content))
        blocks += content + bytes(-len(content) % BLOCK)
    blocks += ZERO_BLOCK * 2
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31)
    body = compressor.compress(bytes(blocks)) + compressor.flush()
    # zlib writes mtime 0 and no name; the OS byte is fixed to "unknown" for every platform
    return body[:9] + b"\xff" + body[10:]


def _ustar_header(name: bytes, size: int) -> bytes:
    header = bytearray(BLOCK)
    header[0 : len(name)] = name
    header[100:108] = b"%07o\0" % FILE_MODE
    header[108:116] = b"%07o\0" % 0
    header[116:124] = b"%07o\0" % 0
    header[124:136] = b"%011o\0" % size
    header[136:148] = b"%011o\0" % FIXED_MTIME
    header[148:156] = b" " * 8
    header[156:157] = b"0"
    header[257:265] = b"ustar\x0000"
    header[148:156] = b"%06o\0 " % sum(header)
    return bytes(header)

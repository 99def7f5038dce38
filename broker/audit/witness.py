"""Witnessing: each checkpoint is offered to witnesses, whose cosignatures are added to it, so a
split view (one log shown to some auditors, another to others) needs a colluding witness.

* C2SP ``tlog-witness``: ``POST <witness>/add-checkpoint`` with ``old <size>``, the consistency
  proof from that size (base64 hashes, one per line), an empty line, and the signed checkpoint.
  ``200`` answers cosignature lines; ``409`` answers the size the witness already holds
  (``text/x.tlog.size``), and the request is made once more from there.
* C2SP ``tlog-cosignature`` (``cosignature/v1``): a note signature line whose blob is
  key ID (4) || timestamp (8, big-endian seconds) || Ed25519 signature over
  ``"cosignature/v1\\ntime <timestamp>\\n" + checkpoint body``; the key ID is the first four
  bytes of SHA-256(name || "\\n" || 0x04 || public key).

Best effort: a witness that is down or refuses leaves the checkpoint with the log's own signature
only (logged); ``broker audit verify --witness-key`` is where a missing cosignature fails.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric import ed25519

from broker.crypto.checkpoint import SIGNATURE_PREFIX, parse_key_text

log = logging.getLogger(__name__)
ALG_COSIGNATURE_V1 = b"\x04"
MAX_ANSWER_BYTES = 16 * 1024


def cosignature_key_id(name: str, public_raw: bytes) -> bytes:
    return hashlib.sha256(name.encode() + b"\n" + ALG_COSIGNATURE_V1 + public_raw).digest()[:4]


def cosigned_message(body: str, timestamp: int) -> bytes:
    return f"cosignature/v1\ntime {timestamp}\n".encode() + body.encode()


def cosignature_line(name: str, key: ed25519.Ed25519PrivateKey, body: str, timestamp: int) -> str:
    """What a witness returns (used by tests' witness, and documented for operators)."""
    public = key.public_key().public_bytes_raw()
    blob = (
        cosignature_key_id(name, public)
        + struct.pack(">Q", timestamp)
        + key.sign(cosigned_message(body, timestamp))
    )
    return f"{SIGNATURE_PREFIX}{name} {base64.b64encode(blob).decode()}\n"


def witness_verifier_key(name: str, public_raw: bytes) -> str:
    """``<name>+<hex key id>+<base64(0x04 || public key)>``."""
    encoded = base64.b64encode(ALG_COSIGNATURE_V1 + public_raw).decode()
    return f"{name}+{cosignature_key_id(name, public_raw).hex()}+{encoded}"


@dataclass(frozen=True)
class WitnessKey:
    name: str
    key_id: bytes
    public: ed25519.Ed25519PublicKey

    @classmethod
    def parse(cls, text: str) -> WitnessKey:
        """Raises: NoteError for anything but a cosignature/v1 Ed25519 key of matching id."""
        name, expected, public = parse_key_text(text, ALG_COSIGNATURE_V1, cosignature_key_id)
        return cls(name, expected, public)

    def cosigned(self, note: str, body: str) -> bool:
        """Whether ``note`` carries a valid cosignature by this witness over ``body``."""
        for line in note.splitlines():
            if not line.startswith(f"{SIGNATURE_PREFIX}{self.name} "):
                continue
            try:
                blob = base64.b64decode(line.rsplit(" ", 1)[1], validate=True)
            except ValueError:
                continue
            if len(blob) != 76 or blob[:4] != self.key_id:
                continue
            timestamp = struct.unpack(">Q", blob[4:12])[0]
            try:
                self.public.verify(blob[12:], cosigned_message(body, timestamp))
            except InvalidSignature:
                continue
            return True
        return False


@dataclass
class Witness:
    url: str
    key: WitnessKey
    size: int = 0  # the tree size this witness last cosigned


async def request_cosignature(
    session: aiohttp.ClientSession,
    witness: Witness,
    *,
    note: str,
    body: str,
    size: int,
    proof_from: object,
) -> str | None:
    """One witness's cosignature line for ``note``, or ``None`` (logged). ``proof_from(old)``
    gives the consistency proof (list of hashes) from ``old`` to ``size``."""
    old = witness.size
    for _ in range(2):  # once more after a 409 tells us the witness's size
        proof: Sequence[bytes] = proof_from(old) if 0 < old < size else []  # type: ignore[operator]
        payload = f"old {old}\n" + "".join(base64.b64encode(h).decode() + "\n" for h in proof)
        payload += "\n" + note
        try:
            async with session.post(
                witness.url.rstrip("/") + "/add-checkpoint",
                data=payload.encode(),
                timeout=aiohttp.ClientTimeout(total=5),
            ) as reply:
                text = (await reply.content.read(MAX_ANSWER_BYTES)).decode("utf-8", "replace")
                status = reply.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("witness %s unreachable: %s", witness.url, exc)
            return None
        if status == 409 and text.strip().isdigit():
            old = int(text.strip())
            continue
        if status != 200:
            log.warning("witness %s refused the checkpoint: %s %s", witness.url, status, text[:200])
            return None
        lines = [line + "\n" for line in text.splitlines() if line.startswith(SIGNATURE_PREFIX)]
        good = [line for line in lines if witness.key.cosigned(line, body)]
        if not good:
            log.warning("witness %s answered no valid cosignature", witness.url)
            return None
        witness.size = size
        return good[0]
    return None

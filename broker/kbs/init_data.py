"""A guest's init-data, and its binding to the evidence (docs/kbs.md, "Init-data").

Init-data is the TOML document a CoCo pod is launched with (Trustee's ``kbs/docs/initdata.md``:
``version``, ``algorithm``, ``data``, a table of strings, e.g. the ``aa.toml`` and ``cdh.toml``
that name the KBS). The host sets its digest, ``algorithm`` over the document's bytes, into a
launch field the hardware then signs: TDX ``MRCONFIGID`` (48 bytes), SEV-SNP ``HOST_DATA`` (32),
the digest zero-padded or truncated to the field (guest-components
``attestation-agent/attester/src/{tdx,snp}/mod.rs bind_init_data``; Trustee
``deps/verifier/src/{tdx,snp}/mod.rs`` and ``regularize_data``). The guest sends the document in
``POST /kbs/v0/attest`` as ``{"format": "toml", "body": "<document>"}``
(``kbs_protocol/src/client/rcar_client.rs``); Trustee accepts only ``toml``
(``kbs/src/attestation/coco/builtin.rs``).

So: ``parse_init_data`` reads the document as Trustee does (unverified), and ``bind_init_data``
accepts it only if its digest is the one the evidence carries in that field; only then does the
policy see it (``VerifiedInitData``). Pure.
"""

from __future__ import annotations

import hmac
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives import hashes

from broker.core.errors import AttestationError, ErrorCode, InputError
from broker.kbs.wire import HASH_ALGORITHMS

INIT_DATA_FORMAT = "toml"  # the only format guests send and Trustee reads


@dataclass(frozen=True)
class UnverifiedInitData:
    """The guest's init-data as sent: its declared algorithm and the digest of its body."""

    algorithm: str  # a kbs_types HashAlgorithm name: sha256, sha384, sha512 (or sm3)
    digest: bytes  # ``algorithm`` over the body's UTF-8 bytes


@dataclass(frozen=True)
class VerifiedInitData:
    """Init-data whose digest the hardware signed in ``field`` (``mrconfigid`` or ``host_data``):
    what the policy and the record see (``as_claims``)."""

    algorithm: str
    digest: bytes
    field: str

    def as_claims(self) -> dict[str, str]:
        return {"algorithm": self.algorithm, "digest": self.digest.hex(), "field": self.field}


def parse_init_data(unverified: Any) -> UnverifiedInitData | None:
    """``init-data`` of an ``Attestation``: ``null``, or ``{"format": "toml", "body": …}`` whose
    body is TOML with ``version`` (a string), ``algorithm`` (a hash the guest knows) and
    ``data`` (a table of strings), as Trustee's ``Initdata`` requires them.

    Raises:
        InputError: ``bad_request`` naming what is wrong.
    """
    if unverified is None:
        return None
    if not isinstance(unverified, dict) or set(unverified) != {"format", "body"}:
        raise InputError("init-data is an object of exactly format and body")
    if unverified["format"] != INIT_DATA_FORMAT:
        raise InputError(f'init-data format must be "{INIT_DATA_FORMAT}"')
    body = unverified["body"]
    if not isinstance(body, str):
        raise InputError("init-data body must be a string")
    try:
        raw = body.encode("utf-8")
        document = tomllib.loads(body)
    except (UnicodeEncodeError, tomllib.TOMLDecodeError, RecursionError) as exc:
        raise InputError("init-data body is not a TOML document") from exc
    algorithm = document.get("algorithm")
    data = document.get("data")
    if (
        not isinstance(document.get("version"), str)
        or not isinstance(algorithm, str)
        or algorithm not in HASH_ALGORITHMS
    ):
        raise InputError(
            f"init-data needs a version and an algorithm, one of {', '.join(HASH_ALGORITHMS)}"
        )
    if not isinstance(data, Mapping) or not all(isinstance(v, str) for v in data.values()):
        raise InputError("init-data needs data, a table of strings")
    digest = hashes.Hash(HASH_ALGORITHMS[algorithm]())
    digest.update(raw)
    return UnverifiedInitData(algorithm=algorithm, digest=digest.finalize())


def bind_init_data(
    init_data: UnverifiedInitData | None, bound: tuple[str, bytes] | None
) -> VerifiedInitData | None:
    """The init-data the evidence binds, or ``None`` when the guest sent none.

    ``bound`` is the evidence's launch field (name, value), ``None`` for evidence that has none
    (``sample``: then nothing is bound and the policy sees no init-data). A guest that sends no
    init-data is accepted whatever the field holds, as Trustee accepts it (a guest given only
    the digest cannot send the document): the policy pins the field itself among the
    measurements (``mrconfigid``, ``host_data``) when it must.

    Raises:
        AttestationError: ``kbs_init_data_mismatch``: the digest is not the field's.
    """
    if init_data is None or bound is None:
        return None
    field, value = bound
    expected = init_data.digest[: len(value)].ljust(len(value), b"\0")
    if not hmac.compare_digest(expected, value):
        raise AttestationError(
            f"the init-data's {init_data.algorithm} digest is not the evidence's {field}: "
            "the guest was launched with other init-data",
            code=ErrorCode.KBS_INIT_DATA_MISMATCH,
        )
    return VerifiedInitData(init_data.algorithm, init_data.digest, field)

"""Protocol constants shared by the broker and the runner SDK."""

from __future__ import annotations

from enum import StrEnum


class Algorithm(StrEnum):
    """What the wrapped material is."""

    AES_256 = "AES-256"  # a 32-byte data key
    HPKE_X25519 = "HPKE-X25519"  # RFC 9180 DHKEM(X25519) private key (32 bytes)
    HPKE_MLKEM768_X25519 = "HPKE-MLKEM768-X25519"  # ML-KEM-768 seed (64) || X25519 (32)


# ``input.request.kind`` of an attestation's policy input (``POST /v1/attest``): the policy
# engines evaluate ``data.broker.attest`` for it and ``data.broker.release`` for every other
# input. Only the broker writes the policy input, so a runner cannot choose the package.
ATTEST_KIND = "attest"
IDENTITY_KIND = "identity"  # input.request.kind of a workload certificate (data.broker.identity)
# One part of a KBS resource path ``<repository>/<type>/<tag>`` the facade serves (docs/kbs.md):
# the request parser and the ``[kbs.resources]`` check share it
KBS_PATH_SEGMENT = r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}"
# Intel's TCB statuses a verified TDX quote can carry (Revoked is refused before any policy), and
# the SEV-SNP products whose AMD roots the broker pins: the verifiers and the KBS policy data's
# shape check (``policy/kbs_data.py``) share them.
TDX_TCB_STATUSES = frozenset(
    {
        "UpToDate",
        "SWHardeningNeeded",
        "ConfigurationNeeded",
        "ConfigurationAndSWHardeningNeeded",
        "OutOfDate",
        "OutOfDateConfigurationNeeded",
    }
)
SNP_PRODUCTS = ("Milan", "Genoa", "Turin")

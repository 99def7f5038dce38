"""The shape of the KBS facade's policy data (docs/kbs.md), one of the structure rules
(``structure.py``: ``broker policy check|test|build``, every load from a directory and every
bundle): ``data.broker.kbs_guests``, ``kbs_tcb_statuses`` and ``kbs_snp_min_tcb``.

The shipped ``release.rego`` already lets a malformed reference match nothing (and says why); the
check refuses the data first, so that a team learns of a reference without measurements (which
would otherwise have matched every guest of its technology), a typo such as ``measurement``, or
a minimum TCB missing an SPL before any guest asks. Pure.

* ``kbs_guests``: ``{"<key>": [reference, …]}``, a non-empty list per key; a reference is an
  object of ``technology`` (a string), ``measurements`` (a non-empty object) and optionally
  ``tcb_statuses`` and ``snp_min_tcb``, nothing else;
* ``tcb_statuses`` / ``kbs_tcb_statuses``: a non-empty list of Intel's TCB statuses;
* ``snp_min_tcb`` / ``kbs_snp_min_tcb[<product>]``: SPLs ``bootloader``, ``tee``, ``snp``,
  ``microcode`` (and ``fmc``, required on Turin) as integers 0..255, nothing else; the products
  are AMD's (``Milan``, ``Genoa``, ``Turin``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from broker.core.protocol import SNP_PRODUCTS, TDX_TCB_STATUSES
from broker.policy.wasm import PolicyLoadError

REFERENCE_MEMBERS = frozenset({"technology", "measurements", "tcb_statuses", "snp_min_tcb"})
SNP_SPLS = ("bootloader", "tee", "snp", "microcode")
TURIN_SPLS = (*SNP_SPLS, "fmc")
MAX_SPL = 255  # one byte of a TCB_VERSION


def check_kbs_data(where: str, broker: Mapping[str, Any]) -> None:
    """The three members of ``data.broker`` the KBS branch reads, where present.

    Raises:
        PolicyLoadError: naming ``where``, the member and what is wrong.
    """
    guests = broker.get("kbs_guests", {})
    if not isinstance(guests, Mapping):
        raise _bad(where, "kbs_guests", 'is an object {"<key>": [reference, …]}')
    for key, references in guests.items():
        name = f"kbs_guests[{key!r}]"
        if not isinstance(references, list) or not references:
            raise _bad(where, name, "is a non-empty list of references")
        for index, reference in enumerate(references):
            _check_reference(where, f"{name}[{index}]", reference)
    if "kbs_tcb_statuses" in broker:
        _check_statuses(where, "kbs_tcb_statuses", broker["kbs_tcb_statuses"])
    minimums = broker.get("kbs_snp_min_tcb", {})
    if not isinstance(minimums, Mapping):
        raise _bad(where, "kbs_snp_min_tcb", 'is an object {"<product>": {SPLs}}')
    for product, minimum in minimums.items():
        if product not in SNP_PRODUCTS:
            raise _bad(where, f"kbs_snp_min_tcb[{product!r}]", f"names none of {SNP_PRODUCTS}")
        _check_minimum(where, f"kbs_snp_min_tcb[{product!r}]", minimum, product)


def _check_reference(where: str, name: str, reference: Any) -> None:
    if not isinstance(reference, Mapping):
        raise _bad(where, name, "is an object")
    unknown = sorted(set(reference) - REFERENCE_MEMBERS)
    if unknown:
        raise _bad(
            where, name, f"has unknown members {unknown} (allowed: {sorted(REFERENCE_MEMBERS)})"
        )
    if not isinstance(reference.get("technology"), str):
        raise _bad(where, name, "needs a technology (tdx, sev-snp, sample)")
    measurements = reference.get("measurements")
    if not isinstance(measurements, Mapping) or not measurements:
        raise _bad(
            where,
            name,
            "needs measurements, a non-empty object: without one it would match every guest "
            "of its technology",
        )
    if "tcb_statuses" in reference:
        _check_statuses(where, f"{name}.tcb_statuses", reference["tcb_statuses"])
    if "snp_min_tcb" in reference:
        _check_minimum(where, f"{name}.snp_min_tcb", reference["snp_min_tcb"], None)


def _check_statuses(where: str, name: str, statuses: Any) -> None:
    if (
        not isinstance(statuses, list)
        or not statuses
        or not all(isinstance(s, str) and s in TDX_TCB_STATUSES for s in statuses)
    ):
        raise _bad(where, name, f"is a non-empty list of {sorted(TDX_TCB_STATUSES)}")


def _check_minimum(where: str, name: str, minimum: Any, product: str | None) -> None:
    """SPLs, each an integer 0..255: the four of every product, FMC on Turin (a reference's
    minimum, for any product, may name FMC)."""
    required = TURIN_SPLS if product == "Turin" else SNP_SPLS
    allowed = set(TURIN_SPLS)
    if not isinstance(minimum, Mapping) or not set(required) <= set(minimum) <= allowed:
        raise _bad(
            where, name, f"names {list(required)} (fmc too on Turin, optional elsewhere), no more"
        )
    for spl, level in minimum.items():
        if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level <= MAX_SPL:
            raise _bad(where, f"{name}.{spl}", f"is an integer 0..{MAX_SPL}")


def _bad(where: str, name: str, problem: str) -> PolicyLoadError:
    return PolicyLoadError(f"{where}: data.broker.{name} {problem}")

"""Evidence of every kind (GPU reports, NRAS tokens, RIMs) malformed or forged."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

from tests.integration.hostile.common import (
    DELETE,
    Case,
    Ctx,
    Fresh,
    b64std,
    release,
)
from tests.support.constants import GPU_KEY
from tests.vectors.gpu import pem

# --- evidence of every kind --------------------------------------------------------------------


def evidence_case(
    name: str,
    status: int,
    code: str | None,
    make: Callable[[Ctx, Fresh], Any],
    *,
    key: str = GPU_KEY,
) -> Case:
    async def build(ctx: Ctx) -> Any:
        fresh = await ctx.fresh(gpu_cc_mode="ON")
        evidence = {"gca": fresh.token, **make(ctx, fresh)}
        return fresh.body(key=key, evidence={k: v for k, v in evidence.items() if v is not DELETE})

    return release(f"evidence.{name}", build, status, code)


def _item(ctx: Ctx, fresh: Fresh, **change: Any) -> dict[str, Any]:
    return {**ctx.gpu.evidence(fresh.gpu_nonce)["evidence_list"][0], **change}


def _truncated(ctx: Ctx, fresh: Fresh, cut: int) -> dict[str, Any]:
    report = ctx.gpu.report(fresh.gpu_nonce)
    return {"nvidia": {"evidence_list": [_item(ctx, fresh, evidence=b64std(report[:cut]))]}}


def _flipped_report(ctx: Ctx, fresh: Fresh) -> dict[str, Any]:
    report = bytearray(ctx.gpu.report(fresh.gpu_nonce))
    report[60] ^= 1  # inside the measurement record: the signature no longer verifies
    return {"nvidia": {"evidence_list": [_item(ctx, fresh, evidence=b64std(bytes(report)))]}}


def evidence_cases() -> list[Case]:
    nv = "nvidia"
    cases = [
        evidence_case(
            "control.local_gpu", 200, None, lambda c, f: {nv: c.gpu.evidence(f.gpu_nonce)}
        ),
        evidence_case("control.nras", 200, None, lambda c, f: {"nras": c.nras.result(f.gpu_nonce)}),
        evidence_case("unsupported_kind", 400, "evidence_unsupported", lambda c, f: {"sev": "x"}),
        evidence_case(
            "ita_not_configured", 400, "evidence_unsupported", lambda c, f: {"ita": f.token}
        ),
        evidence_case(
            "two_gpu_kinds", 400, "evidence_unsupported", lambda c, f: {nv: {}, "nras": []}
        ),
        evidence_case("nvidia.not_object", 401, "evidence_malformed", lambda c, f: {nv: "x"}),
        evidence_case("nvidia.empty", 401, "evidence_malformed", lambda c, f: {nv: {}}),
        evidence_case(
            "nvidia.extra_member",
            401,
            "evidence_malformed",
            lambda c, f: {nv: {**c.gpu.evidence(f.gpu_nonce), "x": 1}},
        ),
        evidence_case(
            "nvidia.arch_list",
            401,
            "evidence_malformed",
            lambda c, f: {nv: {**c.gpu.evidence(f.gpu_nonce), "arch": ["HOPPER"]}},
        ),
        evidence_case(
            "nvidia.arch_unknown",
            401,
            "evidence_malformed",
            lambda c, f: {nv: {**c.gpu.evidence(f.gpu_nonce), "arch": "VOLTA"}},
        ),
        evidence_case(
            "nvidia.arch_contradicts",
            401,
            "gpu_arch_mismatch",
            lambda c, f: {nv: {**c.gpu.evidence(f.gpu_nonce), "arch": "BLACKWELL"}},
        ),
        evidence_case(
            "nvidia.list_empty", 401, "evidence_malformed", lambda c, f: {nv: {"evidence_list": []}}
        ),
        evidence_case(
            "nvidia.list_9",
            401,
            "evidence_malformed",
            lambda c, f: {nv: {"evidence_list": [_item(c, f)] * 9}},
        ),
        evidence_case(
            "nvidia.list_not_list",
            401,
            "evidence_malformed",
            lambda c, f: {nv: {"evidence_list": {"a": 1}}},
        ),
        evidence_case(
            "nvidia.item_not_object",
            401,
            "evidence_malformed",
            lambda c, f: {nv: {"evidence_list": ["x"]}},
        ),
        evidence_case(
            "nvidia.item_extra",
            401,
            "evidence_malformed",
            lambda c, f: {nv: {"evidence_list": [_item(c, f, extra=1)]}},
        ),
        evidence_case(
            "nvidia.item_number",
            401,
            "evidence_malformed",
            lambda c, f: {nv: {"evidence_list": [_item(c, f, evidence=7)]}},
        ),
        evidence_case(
            "nvidia.bad_base64",
            401,
            "evidence_malformed",
            lambda c, f: {nv: {"evidence_list": [_item(c, f, evidence="!!!")]}},
        ),
        evidence_case(
            "nvidia.report_garbage",
            401,
            "evidence_malformed",
            lambda c, f: {nv: {"evidence_list": [_item(c, f, evidence=b64std(bytes(300)))]}},
        ),
        evidence_case(
            "nvidia.report_empty",
            401,
            "evidence_malformed",
            lambda c, f: {nv: {"evidence_list": [_item(c, f, evidence="")]}},
        ),
        evidence_case("nvidia.report_flipped", 401, "evidence_signature_invalid", _flipped_report),
        evidence_case(
            "nvidia.chain_not_pem",
            401,
            "cert_chain_invalid",
            lambda c, f: {nv: {"evidence_list": [_item(c, f, certificate=b64std(b"not pem"))]}},
        ),
        evidence_case(
            "nvidia.chain_short",
            401,
            "cert_chain_invalid",
            lambda c, f: {
                nv: {"evidence_list": [_item(c, f, certificate=b64std(pem(c.gpu.chain[:4])))]}
            },
        ),
        evidence_case(
            "nvidia.chain_other_root",
            401,
            "cert_chain_invalid",
            lambda c, f: {nv: c.stranger_gpu.evidence(f.gpu_nonce)},
        ),
        evidence_case(
            "nvidia.chain_too_big",
            401,
            "evidence_malformed",
            lambda c, f: {nv: {"evidence_list": [_item(c, f, certificate=b64std(b"A" * 70_000))]}},
        ),
        evidence_case(
            "nvidia.nonce_other",
            401,
            "nonce_mismatch",
            lambda c, f: {nv: c.gpu.evidence(bytes(32))},
        ),
        evidence_case(
            "nras.not_json", 401, "evidence_malformed", lambda c, f: {"nras": "not json"}
        ),
        evidence_case("nras.empty_list", 401, "evidence_malformed", lambda c, f: {"nras": []}),
        evidence_case("nras.object", 401, "evidence_malformed", lambda c, f: {"nras": {"a": 1}}),
        evidence_case(
            "nras.non_ascii",
            401,
            "evidence_malformed",
            lambda c, f: {"nras": [["JWT", "é.é.é"], {"GPU-0": "a.b.c"}]},
        ),
        evidence_case(
            "nras.no_gpus", 401, "evidence_malformed", lambda c, f: {"nras": [["JWT", "a.b.c"], {}]}
        ),
        evidence_case(
            "nras.garbage_tokens",
            401,
            "token_malformed",
            lambda c, f: {"nras": [["JWT", "a.b.c"], {"GPU-0": "a.b.c"}]},
        ),
        evidence_case(
            "nras.other_nonce",
            401,
            "nonce_mismatch",
            lambda c, f: {"nras": c.nras.result(bytes(32))},
        ),
        evidence_case(
            "nras.string_form_nested",
            401,
            "evidence_malformed",
            lambda c, f: {"nras": json.dumps([[["JWT"]]])},
        ),
    ]
    for cut in (0, 10, 37, 80, 200, -97, -1):
        cases.append(
            evidence_case(
                f"nvidia.report_truncated[{cut}]",
                401,
                "evidence_malformed",
                functools.partial(_truncated, cut=cut),
            )
        )
    cases.append(
        evidence_case(
            "cpu_missing",
            400,
            "evidence_unsupported",
            lambda c, f: {"gca": DELETE, nv: c.gpu.evidence(f.gpu_nonce)},
        )
    )
    return cases

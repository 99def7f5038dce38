"""The hostile-input table: every endpoint, as an attacker would call it. Each case names the
exact status and error code it must get; ``logged`` marks release requests whose body parsed,
which must each leave exactly one decision record.

Cases are generated from small tables (fields x wrong values, JWK members, token headers and
claims, evidence shapes), so adding a row adds cases. ``test_hostile_inputs.py`` runs them.
"""

from tests.integration.hostile.common import ADMIN_TOKEN, NO_BODY, Case, Ctx
from tests.integration.hostile.evidence import evidence_cases
from tests.integration.hostile.requests import jwk_cases, nonce_cases, shape_cases, wire_cases
from tests.integration.hostile.surfaces import admin_cases, log_cases, surface_cases
from tests.integration.hostile.tokens import token_cases

__all__ = ["ADMIN_TOKEN", "NO_BODY", "Case", "Ctx", "all_cases"]


def all_cases(max_body: int) -> list[Case]:
    return [
        *shape_cases(),
        *wire_cases(max_body),
        *jwk_cases(),
        *token_cases(),
        *evidence_cases(),
        *nonce_cases(),
        *surface_cases(),
        *admin_cases(),
        *log_cases(),
    ]

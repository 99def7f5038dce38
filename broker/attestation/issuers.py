"""What the broker trusts about one token issuer (the ``[[issuers]]`` table, parsed by config)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DEFAULT_ALGORITHMS = {"gca": ("RS256",), "ita": ("PS384", "RS256"), "nras": ("ES384",)}


@dataclass(frozen=True)
class IssuerSettings:
    kind: str
    issuer: str
    jwks_file: Path | None = None
    jwks_url: str | None = None
    algorithms: tuple[str, ...] = ()  # empty: DEFAULT_ALGORITHMS[kind]
    token_types: tuple[str, ...] = ("oidc",)  # gca only: "oidc" (JWKS) and/or "pki" (x5c)
    root_cert: Path | None = None  # gca pki: CS root; ita: Intel root; nras: pinned intermediate
    tolerated_jku: tuple[str, ...] = ()  # a jku header equal to one of these is ignored
    jwks_refresh_min_seconds: int = 30
    jwks_cache_seconds: int = 3600
    # Longest accepted exp - iat. Google's, NVIDIA's: 3600 s; Intel's: 300 s. A longer-lived
    # token is refused (token_claim_invalid): a stolen one would stay useful for longer.
    max_token_lifetime_seconds: int = 3600

    @property
    def effective_algorithms(self) -> tuple[str, ...]:
        return self.algorithms or DEFAULT_ALGORITHMS[self.kind]

    @property
    def uses_jwks(self) -> bool:
        return self.kind != "gca" or "oidc" in self.token_types

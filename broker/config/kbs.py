"""``[kbs]`` (docs/configuration.md, docs/kbs.md): read with its ``[kbs.resources]`` table, and
checked. ``broker.config`` calls both; import ``KbsSettings`` from ``broker.config``."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from broker.config.checks import MAX_EAR_TTL_SECONDS, is_loopback
from broker.config.sections import KbsSettings, Settings, split_listen
from broker.config.tables import config_table
from broker.core.errors import ConfigError
from broker.core.protocol import KBS_PATH_SEGMENT

RESOURCE_PATH = re.compile(rf"{KBS_PATH_SEGMENT}/{KBS_PATH_SEGMENT}/{KBS_PATH_SEGMENT}")
# a key name's form (keys/service.py's KEY_NAME; config may not import the key service)
KEY_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*(/[a-z0-9][a-z0-9._-]*)*")
DENY_STATUSES = (401, 403)
MAX_RESOURCES = 10_000
MAX_AUTH_RATE = 10_000  # handshakes per second per address
MAX_AUTH_BURST = 100_000


def kbs_settings(raw: Mapping[str, Any], env: Mapping[str, str], base_dir: Path) -> KbsSettings:
    """``[kbs]``, its scalar keys as every table's (``BROKER_KBS_…`` overrides them), and the
    ``[kbs.resources]`` table: ``"<repository>/<type>/<tag>" = "<key>"`` or ``"<key>@<N>"``.

    Raises:
        ConfigError: naming the first bad key.
    """
    table = raw.get("kbs", {})
    if not isinstance(table, dict):
        raise ConfigError("kbs", "must be a table")
    if env.get("BROKER_KBS_RESOURCES"):
        raise ConfigError("kbs.resources", "is read from the file only ([kbs.resources])")
    scalars = {k: v for k, v in table.items() if k != "resources"}
    settings: KbsSettings = config_table(KbsSettings, "kbs", {"kbs": scalars}, env, base_dir)
    return replace(settings, resources=_resources(table.get("resources", {})))


def _resources(raw: Any) -> tuple[tuple[str, str, int | None], ...]:
    if not isinstance(raw, dict) or len(raw) > MAX_RESOURCES:
        raise ConfigError("kbs.resources", f"a table of at most {MAX_RESOURCES} paths")
    mapped = []
    for path, target in sorted(raw.items()):
        key = f"kbs.resources.{path}"
        if not RESOURCE_PATH.fullmatch(path):
            raise ConfigError(key, "a path is <repository>/<type>/<tag> of [A-Za-z0-9._-]")
        if not isinstance(target, str):
            raise ConfigError(key, 'must be "<key name>" or "<key name>@<version>"')
        name, at, version = target.partition("@")
        if at and not (version.isascii() and version.isdigit() and 0 < int(version) < 2**31):
            raise ConfigError(key, "the version after @ is a positive integer")
        if not KEY_NAME.fullmatch(name):  # a key that does not exist is a 404 when asked
            raise ConfigError(key, "a key name is lower-case segments of [a-z0-9._-] joined by /")
        mapped.append((path, name, int(version) if at else None))
    return tuple(mapped)


def validate_kbs(settings: Settings) -> None:
    """The facade's limits, and what it needs of the other sections: attestation results (its
    tokens are results, signed by ``[attest] signing_key``), and, for the development switch,
    a broker on loopback (sample evidence proves nothing: never off this machine).

    Raises:
        ConfigError: naming the key.
    """
    kbs = settings.kbs
    if not 10 <= kbs.session_ttl_seconds <= 3600:
        raise ConfigError("kbs.session_ttl_seconds", "must be 10..3600")
    if not 10 <= kbs.token_ttl_seconds <= MAX_EAR_TTL_SECONDS:
        raise ConfigError("kbs.token_ttl_seconds", f"must be 10..{MAX_EAR_TTL_SECONDS}")
    if kbs.deny_status not in DENY_STATUSES:
        raise ConfigError("kbs.deny_status", "must be 401 (as Trustee) or 403")
    if not 0 <= kbs.auth_rate_per_ip <= MAX_AUTH_RATE:
        raise ConfigError("kbs.auth_rate_per_ip", f"must be 0 (off) .. {MAX_AUTH_RATE}")
    if not 1 <= kbs.auth_rate_burst <= MAX_AUTH_BURST:
        raise ConfigError("kbs.auth_rate_burst", f"must be 1..{MAX_AUTH_BURST}")
    if not kbs.enabled:
        return
    if not settings.attest.enabled:
        raise ConfigError("kbs.enabled", "the KBS facade needs [attest] enabled (its tokens)")
    if kbs.allow_sample_evidence and not _on_loopback(settings):
        raise ConfigError(
            "kbs.allow_sample_evidence",
            "sample evidence proves nothing: allowed only on a broker that listens on loopback",
        )


def _on_loopback(settings: Settings) -> bool:
    try:
        return is_loopback(split_listen(settings.server.listen)[0])
    except ValueError:
        return False

"""What the KBS facade's tests share (issue 33): a broker with ``[attest]`` and ``[kbs]`` on (the
development switch for ``sample`` evidence on, a resource mapped to the test key and one to a
key the policy gives no KBS guest), and the shipped policy's data allowing ``sample`` guests
the test key. Guests are ``tests/support/kbs_client.Guest``."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from tests.integration.attested import DENIED_KEY, attest_broker
from tests.integration.conftest import RunningBroker
from tests.integration.identity import identity_broker
from tests.support.constants import KEY
from tests.support.kbs_client import Guest

RESOURCE = "default/llama/dek"  # -> KEY, the newest version
PINNED = "default/llama/dek-v1"  # -> KEY version 1
DENIED_RESOURCE = "default/other/dek"  # -> DENIED_KEY: no KBS guest is allowed it
UNMAPPED = "default/nothing/here"
KBS_TOML = f"""
[kbs]
enabled = true
allow_sample_evidence = true
session_ttl_seconds = 300
token_ttl_seconds = 300

[kbs.resources]
"{RESOURCE}" = "{KEY}"
"{PINNED}" = "{KEY}@1"
"{DENIED_RESOURCE}" = "{DENIED_KEY}"
"""


def with_kbs_guests(workdir: Path) -> None:
    """The shipped policy's data: ``sample`` guests are allowed ``KEY`` (and nothing else)."""
    data_file = workdir / "policies" / "broker" / "data.json"
    data = json.loads(data_file.read_text(encoding="utf-8"))
    data["kbs_guests"] = {KEY: [{"technology": "sample", "measurements": {"svn": "1"}}]}
    data_file.write_text(json.dumps(data), encoding="utf-8")


def kbs_setup(then: Callable[[Path], None] | None = None) -> Callable[[Path], None]:
    """``with_kbs_guests``, then ``then`` (another workspace set-up)."""

    def set_up(workdir: Path) -> None:
        with_kbs_guests(workdir)
        if then is not None:
            then(workdir)

    return set_up


async def kbs_broker(start_broker: Callable[..., Any], **kwargs: Any) -> RunningBroker:
    extra_toml = KBS_TOML + kwargs.pop("extra_toml", "")
    setup = kbs_setup(kwargs.pop("workdir_setup", None))
    return await attest_broker(start_broker, extra_toml=extra_toml, workdir_setup=setup, **kwargs)


def guest(broker: RunningBroker, kind: str = "P-256") -> Guest:
    return Guest(broker.url, ssl=broker.client_tls, kind=kind)


async def every_record_broker(start_broker: Callable[..., Any], **kwargs: Any) -> RunningBroker:
    """A broker that writes every record type: ``[attest]``, ``[identity]`` and ``[kbs]`` on
    (the readers' tests, ``test_audit_feeds``, ``test_record_readers``, the console's), plus
    ``extra_toml`` and a further ``workdir_setup``, when given."""
    extra_toml = KBS_TOML + kwargs.pop("extra_toml", "")
    return await identity_broker(
        start_broker,
        extra_toml=extra_toml,
        workdir_setup=kbs_setup(kwargs.pop("workdir_setup", None)),
        **kwargs,
    )


async def kbs_records(broker: RunningBroker) -> None:
    """Drive a guest through the facade: a handshake, an attestation, a resource released and
    one refused (a path outside the mapping, before any key): ``kbs_auth``, ``kbs_attest``,
    ``kbs_resource`` allow then deny."""
    one = guest(broker)
    async with aiohttp.ClientSession() as session:
        await one.handshake(session)
        status, body, _ = await one.resource(session, RESOURCE)
        assert status == 200, body
        status, body, _ = await one.resource(session, UNMAPPED)
        assert status == 404, body

"""What the console's tests share: a broker with an auditor token (and an admin token without
that role and one with every role, neither of which may open the console), a per-key policy
whose deny reason holds a script, and an HTTP client that logs in as a browser does."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from html.parser import HTMLParser
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDictProxy

from broker.client import BrokerClientError
from broker.policy import opa_bundle
from broker.policy.build import compile_policy_dir
from broker.policy.testing import find_opa
from tests.integration.conftest import RunningBroker
from tests.integration.every_record import every_kind_of_record
from tests.integration.kbs import every_record_broker
from tests.support.constants import KEY

AUDITOR_TOKEN = "console-auditor-token-7c1e9a"
KEY_ADMIN_TOKEN = "console-key-admin-token-2b8d40"
FULL_ADMIN_TOKEN = "console-full-admin-token-5e03c1"  # every role, auditor included
COOKIE = "__Host-console-session"
CONSOLE_TOML = f"""
[[admin.tokens]]
sha256 = "{hashlib.sha256(AUDITOR_TOKEN.encode()).hexdigest()}"
roles = ["auditor"]

[[admin.tokens]]
sha256 = "{hashlib.sha256(KEY_ADMIN_TOKEN.encode()).hexdigest()}"
roles = ["key-admin", "policy-admin"]

[[admin.tokens]]
sha256 = "{hashlib.sha256(FULL_ADMIN_TOKEN.encode()).hexdigest()}"
roles = ["key-admin", "policy-admin", "auditor"]
"""

OTHER_IMAGE = "sha256:" + "0" * 64
XSS_REASON = "<script>document.title='pwned'</script> no release for this image"
# A per-key policy added to the workspace's: a deny reason a page must show as text.
XSS_POLICY = f"""package broker.key_policies.console_test

import rego.v1

applies_to := [{json.dumps(KEY)}]

deny contains {json.dumps(XSS_REASON)} if input.tee.workload.image_digest == "{OTHER_IMAGE}"
"""


def with_xss_reason(workdir: Path) -> None:
    (workdir / "policies" / "broker" / "xss_reason.rego").write_text(XSS_POLICY)


async def console_broker(start_broker: Callable[..., Any], **kwargs: Any) -> RunningBroker:
    extra = CONSOLE_TOML + kwargs.pop("extra_toml", "")
    broker: RunningBroker = await start_broker(extra_toml=extra, **kwargs)
    return broker


def candidate_bundle(policies: Path, into: Path, *, withdraw: str | None) -> bytes:
    """A policy directory as an unsigned bundle, with ``withdraw``'s allow-list emptied (a
    candidate to compare in the console). Blocking."""
    copy = into / "policies"
    shutil.copytree(policies, copy)
    if withdraw is not None:
        data_file = copy / "broker" / "data.json"
        data = json.loads(data_file.read_text(encoding="utf-8"))
        data["images"][withdraw] = []
        data_file.write_text(json.dumps(data), encoding="utf-8")
    return opa_bundle.pack(dict(compile_policy_dir(copy, opa=find_opa()).files))


class Browser:
    """Requests as the console's pages make them: same origin, the session cookie by hand
    (aiohttp's jar keeps no cookie for an IP address)."""

    def __init__(self, broker: RunningBroker, session: aiohttp.ClientSession) -> None:
        self.broker = broker
        self.session = session
        self.cookie: str | None = None

    def headers(self, origin: str | None = "own") -> dict[str, str]:
        headers = {} if self.cookie is None else {"Cookie": f"{COOKIE}={self.cookie}"}
        if origin is not None:
            headers["Origin"] = self.broker.url if origin == "own" else origin
        return headers

    async def get(self, path: str) -> tuple[int, CIMultiDictProxy[str], str]:
        async with self.session.get(
            self.broker.url + path,
            headers=self.headers(origin=None),
            ssl=self.broker.client_tls,
            allow_redirects=False,
        ) as response:
            return response.status, response.headers, await response.text()

    async def post(
        self, path: str, form: dict[str, str] | None = None, *, origin: str | None = "own"
    ) -> tuple[int, aiohttp.ClientResponse, str]:
        async with self.session.post(
            self.broker.url + path,
            data=form or {},
            headers=self.headers(origin),
            ssl=self.broker.client_tls,
            allow_redirects=False,
        ) as response:
            return response.status, response, await response.text()

    async def login(self, token: str = AUDITOR_TOKEN) -> SimpleCookie:
        status, response, body = await self.post("/console/login", {"token": token})
        assert status == 303, body
        jar: SimpleCookie = SimpleCookie()
        jar.load(response.headers["Set-Cookie"])
        self.cookie = jar[COOKIE].value
        return jar


async def every_kind_broker(start_broker: Callable[..., Any]) -> tuple[RunningBroker, str]:
    """A console broker with attestation, workload certificates and KBS on, holding every kind of
    record a live broker writes, and a refusal whose reason holds a script; the jti of the
    attestation result it revoked."""
    broker = await every_record_broker(
        start_broker, extra_toml=CONSOLE_TOML, workdir_setup=with_xss_reason
    )
    jti = await every_kind_of_record(broker)
    async with broker.client() as client:
        with pytest.raises(BrokerClientError):
            await client.release(KEY, broker.token_source(digest=OTHER_IMAGE))
    return broker, jti


class Tables(HTMLParser):
    """The text of each cell of each table with an id, row by row."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self._table: str | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "table":
            self._table = dict(attrs).get("id")
            if self._table is not None:
                self.tables[self._table] = []
        elif self._table is not None and tag == "tr":
            self.tables[self._table].append([])
        elif self._table is not None and tag == "td":
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "table":
            self._table = None
        elif tag == "td" and self._table is not None and self._cell is not None:
            self.tables[self._table][-1].append(" ".join(" ".join(self._cell).split()))
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def tables(page: str) -> dict[str, list[list[str]]]:
    parser = Tables()
    parser.feed(page)
    return {name: [row for row in found if row] for name, found in parser.tables.items()}

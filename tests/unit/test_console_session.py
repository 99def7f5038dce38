"""The console's session cookie (``broker/console/session.py``): forged, expired, replayed
after log-out, or outliving its token's role, it opens nothing; two workers (two ``SessionKeys``
on one key file) accept each other's sessions and log-outs."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import pytest

from broker.config import AdminSettings
from broker.console.session import (
    CLOCK_SKEW_SECONDS,
    MAX_REVOKED_BYTES,
    MAX_SESSION_SECONDS,
    SESSION_SECONDS,
    SessionKeys,
)

AUDITOR = hashlib.sha256(b"auditor-token").hexdigest()
KEY_ADMIN = hashlib.sha256(b"key-admin-token").hexdigest()
ADMIN = AdminSettings(tokens=((AUDITOR, ("auditor",)), (KEY_ADMIN, ("key-admin",))))
NOW = 1_900_000_000


@pytest.fixture
def log(tmp_path: Path) -> Path:
    return tmp_path / "decisions.log"


def test_a_session_opens_for_its_auditor_and_names_the_token(log: Path) -> None:
    keys = SessionKeys.beside(log)
    session = keys.open(keys.issue(AUDITOR, NOW), ADMIN, NOW + 1)
    assert session is not None
    assert session.who == f"token:{AUDITOR[:12]}"
    assert session.expires == NOW + SESSION_SECONDS
    assert (log.parent / "console.key").stat().st_mode & 0o777 == 0o600


def test_the_cookie_carries_neither_the_token_nor_its_digest(log: Path) -> None:
    cookie = SessionKeys.beside(log).issue(AUDITOR, NOW)
    assert AUDITOR not in cookie
    assert AUDITOR[:12] not in cookie
    assert "auditor-token" not in cookie


@pytest.mark.parametrize("position", [3, 20, 40, -5])
def test_forged_session_cookie_rejected(log: Path, position: int) -> None:
    keys = SessionKeys.beside(log)
    cookie = keys.issue(AUDITOR, NOW)
    flipped = "A" if cookie[position] != "A" else "B"
    forged = cookie[:position] + flipped + cookie[position + 1 :]
    assert keys.open(forged, ADMIN, NOW) is None


def test_extended_expiry_is_a_forgery(log: Path) -> None:
    keys = SessionKeys.beside(log)
    fields = keys.issue(AUDITOR, NOW).split(".")
    fields[4] = str(NOW + 10 * MAX_SESSION_SECONDS)
    assert keys.open(".".join(fields), ADMIN, NOW + SESSION_SECONDS + 1) is None


def test_another_brokers_cookie_rejected(log: Path, tmp_path: Path) -> None:
    other = SessionKeys.beside(tmp_path / "other" / "decisions.log")
    assert SessionKeys.beside(log).open(other.issue(AUDITOR, NOW), ADMIN, NOW) is None


def test_expired_session_rejected(log: Path) -> None:
    keys = SessionKeys.beside(log)
    cookie = keys.issue(AUDITOR, NOW)
    assert keys.open(cookie, ADMIN, NOW + SESSION_SECONDS - 1) is not None
    assert keys.open(cookie, ADMIN, NOW + SESSION_SECONDS) is None


def test_renewal_never_passes_the_maximum_after_log_in(log: Path) -> None:
    keys = SessionKeys.beside(log)
    cookie, now = keys.issue(AUDITOR, NOW), NOW
    while (session := keys.open(cookie, ADMIN, now)) is not None:
        assert session.expires <= NOW + MAX_SESSION_SECONDS
        now += SESSION_SECONDS // 2 + 1  # used every 7.5 minutes: renewed each time
        if now < session.expires:
            assert session.due_for_renewal(now) or session.expires == NOW + MAX_SESSION_SECONDS
            cookie = keys.renew(session, now)
    assert NOW + MAX_SESSION_SECONDS <= now <= NOW + MAX_SESSION_SECONDS + SESSION_SECONDS


@pytest.mark.parametrize(
    "admin",
    [
        AdminSettings(tokens=((KEY_ADMIN, ("key-admin",)),)),  # the token was removed
        AdminSettings(tokens=((AUDITOR, ("key-admin",)),)),  # it lost the auditor role
    ],
)
def test_session_ends_with_its_tokens_auditor_role(log: Path, admin: AdminSettings) -> None:
    keys = SessionKeys.beside(log)
    assert keys.open(keys.issue(AUDITOR, NOW), admin, NOW) is None


@pytest.mark.parametrize(
    "admin",
    [
        AdminSettings(token_sha256=(AUDITOR,)),  # a full admin token (every role)
        AdminSettings(tokens=((AUDITOR, ("auditor", "key-admin")),)),  # it gained a role
    ],
)
def test_only_an_auditor_only_token_holds_a_session(log: Path, admin: AdminSettings) -> None:
    keys = SessionKeys.beside(log)
    assert keys.open(keys.issue(AUDITOR, NOW), ADMIN, NOW) is not None
    assert keys.open(keys.issue(AUDITOR, NOW), admin, NOW) is None


def test_logout_revokes_the_session_for_every_worker(log: Path) -> None:
    first, second = SessionKeys.beside(log), SessionKeys.beside(log)  # two workers, one file
    cookie = first.issue(AUDITOR, NOW)
    session = second.open(cookie, ADMIN, NOW)
    assert session is not None
    other = first.open(first.issue(AUDITOR, NOW), ADMIN, NOW)
    assert other is not None
    assert not first.is_revoked(session)
    second.revoke(session, NOW)
    assert first.is_revoked(session)
    assert not first.is_revoked(other)  # another session of the same token lives on
    assert (log.parent / "console.revoked").stat().st_mode & 0o777 == 0o600


def test_revocations_are_dropped_once_no_copy_can_be_open(log: Path) -> None:
    keys = SessionKeys.beside(log)
    old = keys.open(keys.issue(AUDITOR, NOW), ADMIN, NOW)
    assert old is not None
    keys.revoke(old, NOW)
    later = NOW + MAX_SESSION_SECONDS + CLOCK_SKEW_SECONDS + 1
    young = keys.open(keys.issue(AUDITOR, later), ADMIN, later)
    assert young is not None
    keys.revoke(young, later)
    lines = (log.parent / "console.revoked").read_text().splitlines()
    assert len(lines) == 1  # the first expired: no longer kept


def test_a_copy_renewed_before_the_log_out_stays_revoked_past_the_cookies_expiry(
    log: Path,
) -> None:
    """A stolen copy of the cookie, renewed (used) before its owner logged out, expires after
    the owner's cookie; the log-out holds until no copy can be open (log-in plus the maximum)."""
    keys = SessionKeys.beside(log)
    owners = keys.open(keys.issue(AUDITOR, NOW), ADMIN, NOW)
    assert owners is not None
    stolen = keys.renew(owners, NOW + 600)  # the thief's copy, renewed as it was used
    copy = keys.open(stolen, ADMIN, NOW + 600)
    assert copy is not None
    assert copy.expires > owners.expires
    keys.revoke(owners, NOW + 660)  # the owner logs out with the older cookie
    assert keys.open(stolen, ADMIN, owners.expires + 60) is not None  # past the owner's expiry
    for now in (owners.expires + 60, NOW + MAX_SESSION_SECONDS - 1):
        other = keys.open(keys.issue(AUDITOR, now), ADMIN, now)
        assert other is not None
        keys.revoke(other, now)  # another log-out: the file drops what has expired
        assert keys.is_revoked(copy)  # so a copy renewed again and again stays refused


def test_a_revocation_file_past_its_bound_refuses_every_session_and_keeps_every_entry(
    log: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keys = SessionKeys.beside(log)
    session = keys.open(keys.issue(AUDITOR, NOW), ADMIN, NOW)
    stranger = keys.open(keys.issue(AUDITOR, NOW), ADMIN, NOW)
    assert session is not None
    assert stranger is not None
    revoked = log.parent / "console.revoked"
    filler = "".join(f"{n:064x} {NOW + 3600}\n" for n in range(MAX_REVOKED_BYTES // 76 + 1))
    revoked.write_text(filler)  # others' log-outs, past the bound
    keys.revoke(session, NOW)  # its entry after the first MAX_REVOKED_BYTES
    assert revoked.stat().st_size > MAX_REVOKED_BYTES
    assert revoked.read_text().startswith(filler)  # nothing dropped that is still live
    with caplog.at_level(logging.ERROR, logger="broker.console.session"):
        assert keys.is_revoked(session)  # not missed past the bound
        assert keys.is_revoked(stranger)  # and every other session refused: fail closed
    assert "every console session is refused" in caplog.text
    revoked.write_text("")
    assert not keys.is_revoked(stranger)


@pytest.mark.parametrize(
    "cookie",
    [
        "",
        "v1",
        "v1.a.b.c.d.e.f",
        "v2.a.b.1.2.mac",
        "v1.a.b.x.y.mac",
        "v1." + "A" * 5000,
        "v1.\udcff.b.1.2.mac",
        ".....",
    ],
)
def test_malformed_cookie_opens_nothing_and_never_raises(log: Path, cookie: str) -> None:
    assert SessionKeys.beside(log).open(cookie, ADMIN, NOW) is None


def test_session_ids_are_fresh_at_each_log_in(log: Path) -> None:
    keys = SessionKeys.beside(log)
    sids = {keys.issue(AUDITOR, NOW).split(".")[1] for _ in range(50)}
    assert len(sids) == 50
    assert os.path.exists(log.parent / "console.key")

"""``broker keys restore`` (and ``migrate-store``, the same copy) as recorded changes: a copy
that stops partway used to be logged ``error`` although it had added key versions.

A copy checks every version before it writes one, so a version that differs in the target
refuses the whole copy with nothing written (``error``, true); a copy cut short after a write
(the store failing, another replica adding one of its versions between the check and the write)
is re-read, recorded ``unknown`` (partly made) and names the versions it wrote. Each case runs
the real command on two real workspaces (SQLite key stores, one local KEK, real decision logs);
the faults are another workspace's own key and a store call failing around its real work.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from broker.core.errors import ErrorCode, UpstreamError
from broker.keys.store.base import KeyVersionRecord
from broker.keys.store.sqlite import SqliteKeyStore
from tests.integration.conftest import write_config
from tests.support.cli import Ran, run
from tests.support.issuers import dev_issuer
from tests.support.key_changes import outcomes

NAMES = ("models/a", "models/b", "models/c")


@pytest.fixture(autouse=True)
def blockbuster() -> None:
    """These tests are synchronous: each command runs its own event loop."""


def keys(*args: str, config: Path) -> Ran:
    return run("keys", args[0], "--config", str(config), *args[1:])


def created(config: Path, name: str) -> dict[str, Any]:
    made = keys("create", name, "--purpose", "model-weights", config=config)
    assert made.returncode == 0, made.stderr
    return dict(json.loads(made.stdout))


def listed(config: Path) -> list[dict[str, Any]]:
    return list(json.loads(keys("list", config=config).stdout))


def key_admin(config: Path) -> list[dict[str, Any]]:
    log = config.parent / "decisions.log"
    records = [json.loads(line) for line in log.read_text().splitlines()]
    return [r for r in records if r["type"] == "key_admin"]


def backed_up(tmp_path: Path, names: tuple[str, ...]) -> tuple[Path, str, Path]:
    """A source workspace holding ``names`` and its backup; a second workspace (``dst``) with
    the same KEK and no key yet. (the target's config, the backup's digest, the backup)."""
    src = write_config(tmp_path / "src", dev_issuer())
    for name in names:
        created(src, name)
    backup = tmp_path / "keys.backup.json"
    made = keys("backup", "-o", str(backup), config=src)
    assert made.returncode == 0, made.stderr
    dst = write_config(tmp_path / "dst", dev_issuer())
    shutil.copy2(tmp_path / "src" / "kek.key", tmp_path / "dst" / "kek.key")  # 0600 kept
    return dst, json.loads(made.stdout)["digest"], backup


def test_a_restore_with_a_conflicting_version_writes_nothing(tmp_path: Path) -> None:
    """The target has its own ``models/b``: the restore is refused before ``models/a`` (first
    in the file) is written, and its ``error`` outcome is true."""
    dst, digest, backup = backed_up(tmp_path, NAMES[:2])
    own = created(dst, "models/b")
    refused = keys("restore", str(backup), "--digest", digest, config=dst)
    assert [(k["name"], k["version"], k["created_at"]) for k in listed(dst)] == [
        ("models/b", 1, own["created_at"])  # its own, untouched; no models/a
    ]
    assert refused.returncode == 1
    assert "'models/b' version 1 differs" in refused.stderr
    assert "nothing was written" in refused.stderr
    records = key_admin(dst)
    assert outcomes(records) == [("create", 1, "ok", None), ("restore", None, "error", "conflict")]
    assert "written" not in records[-1]
    assert records[-2]["phase"] == "intent"


@pytest.mark.parametrize("fault", ["store_down", "another_writer"])
def test_a_restore_cut_short_after_a_write_is_unknown_and_names_what_it_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    """The store fails on the second write, or another replica adds its own ``models/b``
    between the check and the write (the store refuses: ``key_exists``): ``models/a`` was
    written, so the outcome is ``unknown`` (partly made, re-read) and names it."""
    dst, digest, backup = backed_up(tmp_path, NAMES)
    add = SqliteKeyStore.add_version
    adds = 0

    async def second_add_fails(store: SqliteKeyStore, record: KeyVersionRecord) -> None:
        nonlocal adds
        adds += 1
        if adds == 2 and fault == "store_down":
            raise UpstreamError("key store is unavailable", code=ErrorCode.KEY_STORE_UNAVAILABLE)
        if adds == 2:  # the other replica's own version 1 lands first
            await add(store, record.evolve(wrapped_dek=record.wrapped_dek[::-1]))
        await add(store, record)

    monkeypatch.setattr(SqliteKeyStore, "add_version", second_add_fails)
    stopped = keys("restore", str(backup), "--digest", digest, config=dst)
    monkeypatch.undo()
    code = "key_store_unavailable" if fault == "store_down" else "key_exists"
    assert stopped.returncode == 1
    assert code in stopped.stderr
    held = [k["name"] for k in listed(dst)]
    assert held == (["models/a"] if fault == "store_down" else ["models/a", "models/b"])
    records = key_admin(dst)
    assert outcomes(records) == [("restore", None, "unknown", code)]
    outcome = records[-1]
    assert (outcome["written"], outcome["written_versions"]) == (
        1,
        [{"key": "models/a", "version": 1}],
    )
    again = keys("restore", str(backup), "--digest", digest, config=dst)
    if fault == "store_down":  # resumable: the rest is copied, models/a is already there
        assert again.returncode == 0, again.stderr
        report = json.loads(again.stdout)
        assert (report["copied"], report["already_present"]) == (2, 1)
        assert outcomes(key_admin(dst))[-1] == ("restore", None, "ok", None)
    else:  # the other replica's models/b differs: refused, nothing more written
        assert again.returncode == 1
        assert outcomes(key_admin(dst))[-1] == ("restore", None, "error", "conflict")
        assert [k["name"] for k in listed(dst)] == ["models/a", "models/b"]

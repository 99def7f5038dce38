"""The PostgreSQL key store on a real PostgreSQL server started on loopback (conftest).

Each test gets a database of its own. Checked: ``broker keys migrate`` creates and then keeps
the schema (idempotent, refused for a newer schema); an unmigrated database is refused at
start-up with what to run; the lifecycle has the SQLite store's semantics; ``replace`` is a
compare-and-swap, so two rewraps racing from two processes' worth of connections leave every
DEK wrapped exactly once and decryptable; two replicas (processes with their own ports and
logs) share keys and nonces through PostgreSQL, a key disabled through one is refused by the
other within ``metadata_cache_seconds``, and ``broker audit verify`` checks both logs at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import ssl
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import pytest

from broker.config import KeySettings, load_settings
from broker.core.errors import ConfigError, KeyUnavailable, UpstreamError
from broker.keys.factory import open_key_service
from broker.keys.kek.base import dek_aad
from broker.keys.store.base import Purpose, VersionState
from broker.keys.store.postgres import SCHEMA_VERSION, PostgresKeyStore, migrate
from broker.keys.transfer import record_from_json, versions_digest
from tests.integration.conftest import write_config, write_statement_key
from tests.support.cli import Ran, run
from tests.support.constants import KEY
from tests.support.issuers import dev_issuer
from tests.support.key_changes import outcomes
from tests.support.processes import (
    free_port,
    release_body,
    serve,
    stop_replicas,
    wait_ready,
)

NOW = datetime(2026, 11, 30, tzinfo=UTC)


def cli(*args: str, environ: dict[str, str] | None = None) -> Ran:
    return run(*args, env=environ)


async def test_migrate_creates_then_keeps_the_schema_and_refuses_a_newer_one(
    database: str, tmp_path: Path
) -> None:
    settings = KeySettings(store=database, kek=f"local:{tmp_path / 'kek.key'}")
    with pytest.raises(ConfigError, match="broker keys migrate"):
        async with open_key_service(settings, create_missing_kek=True):
            pass
    config = await asyncio.to_thread(write_config, tmp_path / "b", dev_issuer())
    env = {"BROKER_KEYS_STORE": database}
    first = await asyncio.to_thread(cli, "keys", "migrate", "--config", str(config), environ=env)
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout) == {
        "store": "postgresql",
        "schema_version_before": 0,
        "schema_version": SCHEMA_VERSION,
    }
    assert database not in first.stdout  # the URL (it may carry a password) is not printed
    again = await asyncio.to_thread(cli, "keys", "migrate", "--config", str(config), environ=env)
    assert json.loads(again.stdout)["schema_version_before"] == SCHEMA_VERSION
    async with open_key_service(settings, create_missing_kek=True) as keys:
        await keys.create("models/a", Purpose.MODEL_WEIGHTS, now=NOW)
    db = await asyncpg.connect(database)
    try:
        await db.execute("UPDATE broker_schema SET version = version + 1")
    finally:
        await db.close()
    with pytest.raises(ConfigError, match="newer"):
        await migrate(database, timeout_seconds=5)
    with pytest.raises(ConfigError, match="newer"):
        async with open_key_service(settings):
            pass


async def test_lifecycle_and_no_plaintext_in_the_database(database: str, tmp_path: Path) -> None:
    await migrate(database, timeout_seconds=5)
    settings = KeySettings(
        store=database,
        kek=f"local:{tmp_path / 'kek.key'}",
        signing_key=write_statement_key(tmp_path / "statement.pem"),  # query keys are published
    )
    async with open_key_service(settings, create_missing_kek=True) as keys:
        await keys.create("models/a", Purpose.MODEL_WEIGHTS, now=NOW)
        dek1 = await keys.unwrap(await keys.resolve("models/a", None))
        v2 = await keys.rotate("models/a", now=NOW)
        dek2 = await keys.unwrap(v2)
        assert (await keys.resolve("models/a", None)).version == 2
        await keys.set_enabled("models/a", 2, False, now=NOW)
        assert (await keys.resolve("models/a", None)).version == 1
        with pytest.raises(KeyUnavailable):
            await keys.resolve("models/a", 2)
        await keys.set_enabled("models/a", 2, True, now=NOW)
        await keys.destroy("models/a", 1, now=NOW)
        with pytest.raises(KeyUnavailable):
            await keys.resolve("models/a", 1)
        listed = await keys.list_versions("models/a")
        assert [(r.version, r.state, bool(r.wrapped_dek)) for r in listed] == [
            (1, VersionState.DESTROYED, False),
            (2, VersionState.ENABLED, True),
        ]
        assert listed[0].created_at == NOW
        query = await keys.create("queries/q", Purpose.QUERY, now=NOW)
        assert (await keys.resolve("queries/q", 1)).public_key == query.public_key
    db = await asyncpg.connect(database)
    try:
        rows = await db.fetch("SELECT wrapped_dek FROM broker_key_versions")
    finally:
        await db.close()
    stored = b"".join(bytes(row["wrapped_dek"]) for row in rows)
    assert dek1 not in stored
    assert dek2 not in stored


async def test_replace_is_a_compare_and_swap(database: str) -> None:
    await migrate(database, timeout_seconds=5)
    first, second = PostgresKeyStore(database, timeout=5), PostgresKeyStore(database, timeout=5)
    await first.open()
    await second.open()
    try:
        from broker.keys.store.base import KeyVersionRecord  # noqa: PLC0415

        record = KeyVersionRecord(
            name="k",
            version=1,
            purpose=Purpose.GENERIC,
            state=VersionState.ENABLED,
            wrapped_dek=b"w1",
            kek_ref="kek-a",
            created_at=NOW,
        )
        await first.add_version(record)
        moved = record.evolve(wrapped_dek=b"w2", kek_ref="kek-b", updated_at=NOW)
        assert await first.replace(moved, expected=record)
        stale = record.evolve(wrapped_dek=b"w3", kek_ref="kek-c", updated_at=NOW)
        assert not await second.replace(stale, expected=record)  # lost the race
        assert (await second.get_version("k", 1)) == moved
        # the whole row is compared, not only its KEK: a stale state is refused too
        disabled = moved.evolve(state=VersionState.DISABLED)
        assert await first.replace(disabled, expected=moved)
        assert not await second.replace(moved.evolve(wrapped_dek=b"w4"), expected=moved)
        destroyed = disabled.evolve(state=VersionState.DESTROYED, wrapped_dek=b"")
        assert await first.replace(destroyed, expected=disabled)
        assert not await second.replace(disabled, expected=destroyed)  # destroyed is terminal
        assert (await second.get_version("k", 1)) == destroyed
    finally:
        await first.close()
        await second.close()


@pytest.mark.timeout(120)
async def test_two_rewraps_racing_leave_every_dek_wrapped_once(
    database: str, tmp_path: Path
) -> None:
    await migrate(database, timeout_seconds=5)
    old = KeySettings(store=database, kek=f"local:{tmp_path / 'old.key'}")
    async with open_key_service(old, create_missing_kek=True) as keys:
        deks = {}
        for number in range(40):
            record = await keys.create(f"models/m{number}", Purpose.MODEL_WEIGHTS, now=NOW)
            deks[record.name] = await keys.unwrap(record)
    new_kek = f"local:{tmp_path / 'new.key'}"
    from broker.keys.kek.local import create_kek_file  # noqa: PLC0415

    await asyncio.to_thread(create_kek_file, tmp_path / "new.key")
    both = KeySettings(store=database, kek=new_kek, kek_previous=(old.kek,))
    async with (
        open_key_service(both) as first,
        open_key_service(both) as second,
    ):
        reports = await asyncio.gather(first.rewrap(now=NOW), second.rewrap(now=NOW))
    assert sum(r.rewrapped for r in reports) == 40  # each DEK moved by exactly one of them
    only_new = KeySettings(store=database, kek=new_kek)
    async with open_key_service(only_new) as keys:
        for record in await keys.list_versions():
            assert record.kek_ref == keys.kek.reference
            material = await keys.kek.unwrap(record.wrapped_dek, dek_aad(record.name, 1))
            assert material == deks[record.name]


# --- two replicas on one PostgreSQL: keys, nonces; a log each -------------------------------


@pytest.mark.timeout(180)
async def test_two_replicas_share_keys_and_a_disable_reaches_both(
    database: str, tmp_path: Path
) -> None:
    issuer = dev_issuer()
    config = await asyncio.to_thread(write_config, tmp_path / "b", issuer)
    env = {
        "BROKER_KEYS_STORE": database,
        "BROKER_NONCES_STORE": database,
        "BROKER_KEYS_METADATA_CACHE_SECONDS": "0.5",
    }
    for args in (
        ("keys", "migrate", "--config", str(config)),
        ("keys", "create", KEY, "--purpose", "model-weights", "--config", str(config)),
    ):
        done = await asyncio.to_thread(cli, *args, environ=env)
        assert done.returncode == 0, done.stderr
    tls = ssl.create_default_context(cafile=str(tmp_path / "b" / "tls" / "ca.pem"))
    ports = [free_port(), free_port()]
    logs = [tmp_path / f"decisions-r{i}.log" for i in range(2)]
    replicas = [
        serve(config, port, log, database, {**env, "BROKER_SERVER_REPLICA_ID": f"r{i}"})
        for i, (port, log) in enumerate(zip(ports, logs, strict=True))
    ]
    urls = [f"https://127.0.0.1:{port}" for port in ports]
    try:
        for port in ports:
            await asyncio.to_thread(wait_ready, port, tls)
        async with aiohttp.ClientSession() as session:

            async def release(via: int, issued_by: int) -> tuple[int, str]:
                body = await release_body(session, urls[issued_by], tls, issuer)
                async with session.post(urls[via] + "/v1/release", json=body, ssl=tls) as answer:
                    payload = await answer.json()
                    return answer.status, payload.get("error", {}).get("code", "ok")

            assert await release(1, 0) == (200, "ok")  # nonce from r0, key row read by r1
            assert await release(0, 1) == (200, "ok")
            disabled = await asyncio.to_thread(
                cli, "keys", "disable", KEY, "--version", "1", "--config", str(config), environ=env
            )
            assert disabled.returncode == 0, disabled.stderr
            await asyncio.sleep(0.6)  # metadata_cache_seconds: the documented bound
            for via in (0, 1):
                status, code = await release(via, 1 - via)
                assert (status, code) == (409, "key_version_unavailable"), (via, status, code)
    finally:
        await stop_replicas(replicas)
    for replica, log in enumerate(logs):
        records = [json.loads(line) for line in log.read_text().splitlines()]
        assert {r["replica"] for r in records} == {f"r{replica}"}
    verified = await asyncio.to_thread(cli, "audit", "verify", *map(str, logs))
    assert verified.returncode == 0, verified.stdout + verified.stderr
    report = json.loads(verified.stdout)
    assert [entry["replica"] for entry in report["logs"]] == ["r0", "r1"]
    copied = tmp_path / "copy-of-r0.log"
    copied.write_bytes(logs[0].read_bytes())
    twice = await asyncio.to_thread(cli, "audit", "verify", str(logs[0]), str(copied))
    assert twice.returncode == 1
    assert "same replica" in twice.stdout


async def test_store_errors_say_why_authentication_or_unreachable(
    postgresql_url: str, tmp_path: Path
) -> None:
    """A refused login used to read only "key store is unavailable", even with -v."""
    stranger = postgresql_url.replace("broker@", "nobody@")
    down = f"postgresql://broker@127.0.0.1:{free_port()}/postgres"
    for url, why in ((stranger, "refused the credentials"), (down, "is unreachable")):
        settings = KeySettings(store=url, kek=f"local:{tmp_path / 'kek.key'}")
        with pytest.raises(UpstreamError) as caught:
            async with open_key_service(settings, create_missing_kek=True):
                pass
        assert caught.value.code.value == "key_store_unavailable"
        assert why in caught.value.message, caught.value.message
        assert "nobody@" not in caught.value.message  # never the URL


def keys_cli(*args: str, config: Path) -> Any:
    done = run("keys", *args[:1], "--config", str(config), *args[1:])
    assert done.returncode == 0, (args, done.stderr)
    return json.loads(done.stdout)


async def test_keys_move_from_sqlite_to_postgresql_and_through_a_backup(
    database: str, tmp_path: Path
) -> None:
    """`keys migrate` used to create the schema only: after the switch `keys list` was empty."""
    config = await asyncio.to_thread(write_config, tmp_path / "b", dev_issuer())
    for name in ("models/a", "models/b"):
        await asyncio.to_thread(
            keys_cli, "create", name, "--purpose", "model-weights", config=config
        )
    await asyncio.to_thread(keys_cli, "rotate", "models/a", config=config)
    await asyncio.to_thread(keys_cli, "disable", "models/b", "--version", "1", config=config)
    settings = await asyncio.to_thread(load_settings, config)
    sqlite_uri = settings.keys.store
    moved = await asyncio.to_thread(
        keys_cli, "migrate", "--from", sqlite_uri, "--to", database, config=config
    )
    assert (moved["versions"], moved["copied"], moved["already_present"]) == (3, 3, 0)
    again = await asyncio.to_thread(
        keys_cli, "migrate", "--from", sqlite_uri, "--to", database, config=config
    )
    assert (again["copied"], again["already_present"]) == (0, 3)  # idempotent, resumable
    assert again["verified_digest"] == moved["verified_digest"]
    assert "broker@" not in again["to"]  # no credentials in what is printed or logged
    on_postgres = dataclasses.replace(settings.keys, store=database)
    async with (
        open_key_service(settings.keys) as before,
        open_key_service(on_postgres) as after,
    ):
        old = await before.list_versions()
        names = {r.name for r in old}  # the database is shared with other tests
        new = [r for r in await after.list_versions() if r.name in names]
        assert [r.describe() for r in old] == [r.describe() for r in new]
        for record in old:  # the same KEK unwraps the same DEKs: nothing was re-wrapped
            assert await before.unwrap(record) == await after.unwrap(record)

    backup = tmp_path / "keys.backup.json"
    made = await asyncio.to_thread(keys_cli, "backup", "-o", str(backup), config=config)
    assert made["versions"] == 3
    assert oct((await asyncio.to_thread(backup.stat)).st_mode & 0o777) == "0o600"
    restored = await asyncio.to_thread(keys_cli, "restore", str(backup), config=config)
    assert (restored["copied"], restored["already_present"]) == (0, 3)
    log_text = await asyncio.to_thread(settings.audit.log.read_text)
    records = [json.loads(line) for line in log_text.splitlines()]
    actions = [(r["action"], r.get("result")) for r in records if r.get("type") == "key_admin"]
    assert actions[-7:] == [  # a copy into a store: its intent, then its outcome
        ("migrate-store", None),
        ("migrate-store", "ok"),
        ("migrate-store", None),
        ("migrate-store", "ok"),
        ("backup", None),  # a read: one record
        ("restore", None),
        ("restore", "ok"),
    ]
    (restore,) = [r for r in records if r.get("action") == "restore" and "result" in r]
    assert (restore["copied"], restore["already_present"], restore["digest"]) == (
        0,
        3,
        made["digest"],
    )
    assert outcomes([r for r in records if r.get("type") == "key_admin"])[-3:] == [
        ("migrate-store", None, "ok", None),
        ("migrate-store", None, "ok", None),
        ("restore", None, "ok", None),
    ]

    # A fresh broker restores the file only with the digest its operator trusts ...
    fresh = await asyncio.to_thread(write_config, tmp_path / "c", dev_issuer())
    refused = await asyncio.to_thread(run_cli, "restore", str(backup), config=fresh)
    assert refused.returncode == 1
    assert "not one this broker logged" in refused.stderr
    done = await asyncio.to_thread(
        keys_cli, "restore", str(backup), "--digest", made["digest"], config=fresh
    )
    assert done["copied"] == 3
    # ... and a file changed after the backup is refused, re-digested or not.
    document = json.loads(await asyncio.to_thread(backup.read_text))
    document["versions"][2]["state"] = "enabled"  # re-enable a disabled version
    await asyncio.to_thread(backup.write_text, json.dumps(document))
    tampered = await asyncio.to_thread(run_cli, "restore", str(backup), config=config)
    assert tampered.returncode == 1
    assert "does not match its digest" in tampered.stderr
    document["digest"] = versions_digest([record_from_json(v) for v in document["versions"]])
    await asyncio.to_thread(backup.write_text, json.dumps(document))
    redigested = await asyncio.to_thread(run_cli, "restore", str(backup), config=config)
    assert redigested.returncode == 1
    assert "not one this broker logged" in redigested.stderr


def run_cli(*args: str, config: Path) -> Ran:
    return run("keys", *args[:1], "--config", str(config), *args[1:])

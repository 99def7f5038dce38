"""``broker keys migrate`` / ``backup`` / ``restore`` against a PostgreSQL that requires a password
(SCRAM), given every way ``serve`` takes it: in the URL (percent-encoded), in ``PGPASSWORD``, in a
password file (``?passfile=``), and through ``BROKER_KEYS_STORE``.

The finding: ``keys migrate --to postgresql://…`` as docs/keys.md showed failed on the password;
only an undocumented ``PGPASSWORD`` worked, and ``--from``/``--to`` could not take the configured
store (so ``BROKER_KEYS_STORE``, where the docs say the password goes, was no use to ``migrate``).
No password may appear in what the commands print or log.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

from tests.integration.conftest import postgres_bin, write_config
from tests.support.cli import Ran, run
from tests.support.issuers import dev_issuer
from tests.support.processes import free_port, wait_until

PASSWORD = "p@ss/w:rd%1"  # every character a URL must escape
USER = "broker"
# asyncpg, unlike libpq, keeps the backslash of an escaped ":" in a password file's password:
# the password-file account has a password without one (docs/keys.md says so).
FILE_USER, FILE_PASSWORD = "broker_file", "p@ss/w%rd-2"


@pytest.fixture(scope="module")
def password_server() -> Iterator[str]:
    """A scratch PostgreSQL on 127.0.0.1 that accepts ``broker`` only with its password; its
    base URL (no password, no database)."""
    port = free_port()
    pg_bin = postgres_bin()
    base = Path(tempfile.mkdtemp(prefix="broker-pgpw-"))
    data = base / "data"
    secret = base / "password"
    secret.write_text(PASSWORD + "\n")
    as_user: list[str] = []
    if os.geteuid() == 0:  # PostgreSQL refuses to run as root
        shutil.chown(base, "postgres")
        shutil.chown(secret, "postgres")
        as_user = ["runuser", "-u", "postgres", "--"]
    subprocess.run(
        [
            *as_user,
            *(str(pg_bin / "initdb"), "-D", str(data), "-U", USER, f"--pwfile={secret}"),
            *("--auth-host=scram-sha-256", "--auth-local=scram-sha-256"),
        ],
        check=True,
        capture_output=True,
    )
    secret.unlink()
    process = subprocess.Popen(
        [
            *(*as_user, str(pg_bin / "postgres"), "-D", str(data), "-h", "127.0.0.1"),
            *("-p", str(port), "-k", str(data), "-c", "fsync=off"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    isready = [str(pg_bin / "pg_isready"), "-h", "127.0.0.1", "-p", str(port)]
    try:
        wait_until(
            lambda: subprocess.run(isready, capture_output=True, check=False).returncode == 0,
            what="PostgreSQL",
        )
        connect = ("-h", "127.0.0.1", "-p", str(port), "-U", USER)
        env = {"PGPASSWORD": PASSWORD, "PATH": "/usr/bin:/bin"}
        create_role = f"CREATE ROLE {FILE_USER} LOGIN PASSWORD '{FILE_PASSWORD}'"
        psql = [str(pg_bin / "psql"), *connect, "-d", "postgres", "-c", create_role]
        subprocess.run(psql, env=env, check=True, capture_output=True)
        for name, owner in (
            ("by_url", USER),
            ("by_env", USER),
            ("by_passfile", FILE_USER),
            ("configured", USER),
        ):
            createdb = [str(pg_bin / "createdb"), *connect, "-O", owner, name]
            subprocess.run(createdb, env=env, check=True, capture_output=True)
        yield f"127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=20)
        shutil.rmtree(base, ignore_errors=True)


def keys(*args: str, config: Path, env: dict[str, str] | None = None) -> Ran:
    done = run("keys", args[0], "--config", str(config), *args[1:], env=env)
    assert PASSWORD not in done.stdout + done.stderr
    assert quote(PASSWORD, safe="") not in done.stdout + done.stderr
    return done


def ok(done: Ran) -> dict[str, object]:
    assert done.returncode == 0, (done.args, done.stderr)
    value = json.loads(done.stdout)
    assert isinstance(value, dict)
    return value


def test_keys_migrate_backup_restore_take_the_password_every_way_serve_does(
    password_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = write_config(tmp_path / "b", dev_issuer())
    for name in ("models/a", "models/b"):
        ok(keys("create", name, "--purpose", "model-weights", config=config))
    ok(keys("rotate", "models/a", config=config))
    host = password_server

    # No password: refused, and the error says where a password goes.
    refused = keys("migrate", "--to", f"postgresql://{USER}@{host}/by_url", config=config)
    assert refused.returncode == 1
    assert "refused the credentials" in refused.stderr
    assert "PGPASSWORD" in refused.stderr
    assert "Traceback" not in refused.stderr

    # From the configured store (the default of --from) to each target, one way each.
    by_url = f"postgresql://{USER}:{quote(PASSWORD, safe='')}@{host}/by_url"
    moved = ok(keys("migrate", "--to", by_url, config=config))
    assert (moved["versions"], moved["copied"]) == (3, 3)
    assert moved["to"] == f"postgresql://{host}/by_url"
    by_env = ok(
        keys(
            "migrate",
            "--to",
            f"postgresql://{USER}@{host}/by_env",
            config=config,
            env={"PGPASSWORD": PASSWORD},
        )
    )
    assert by_env["copied"] == 3
    passfile = tmp_path / "pgpass"
    passfile.write_text(f"{host}:by_passfile:{FILE_USER}:{FILE_PASSWORD}\n")
    passfile.chmod(0o600)
    by_file = ok(
        keys(
            "migrate",
            "--to",
            f"postgresql://{FILE_USER}@{host}/by_passfile?passfile={passfile}",
            config=config,
        )
    )
    assert by_file["copied"] == 3
    assert by_file["to"] == f"postgresql://{host}/by_passfile"

    # The store configured through BROKER_KEYS_STORE (as serve reads it): the schema, a copy
    # into it from a SQLite path relative to the working directory, list, backup, restore.
    configured = {"BROKER_KEYS_STORE": f"postgresql://{USER}@{host}/configured"}
    with_password = {**configured, "PGPASSWORD": PASSWORD}
    schema = ok(keys("migrate", config=config, env=with_password))
    assert schema["schema_version"] == 1
    monkeypatch.chdir(config.parent)
    copied = ok(keys("migrate", "--from", "sqlite:///keys.db", config=config, env=with_password))
    assert (copied["from"], copied["copied"]) == (f"sqlite:///{config.parent / 'keys.db'}", 3)
    listed = keys("list", config=config, env=with_password)
    assert listed.returncode == 0, listed.stderr
    assert len(json.loads(listed.stdout)) == 3
    backup = tmp_path / "keys.backup.json"
    made = ok(keys("backup", "-o", str(backup), config=config, env=with_password))
    assert made["versions"] == 3
    restored = ok(keys("restore", str(backup), config=config, env=with_password))
    assert (restored["copied"], restored["already_present"]) == (0, 3)
    same = keys("migrate", "--to", configured["BROKER_KEYS_STORE"], config=config, env=configured)
    assert same.returncode == 2  # the configured store on both sides
    assert "same store" in same.stderr

    log = (config.parent / "decisions.log").read_text(encoding="utf-8")
    assert PASSWORD not in log
    assert quote(PASSWORD, safe="") not in log
    assert "passfile=" not in log
    assert FILE_PASSWORD not in log

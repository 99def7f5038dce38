"""Every path a workspace's ``broker.toml`` names is relative to that file, and ``broker dev init
DIR`` / ``broker demo --workdir DIR`` write nothing outside DIR, run as an ordinary user.

The finding: ``broker dev init ./dev`` wrote the key store to ``/dev/keys.db`` (a ``sqlite:///``
path taken relative to ``/``) and read the KEK relative to the working directory; as an ordinary
user it failed with ``Permission denied``, as root every workspace named ``dev`` shared one store.
``broker demo --workdir ./x`` wrote ``/x/keys.db``.

The commands run as subprocesses under a non-root account (created when missing), from a working
directory of their own, with ``HOME`` and ``TMPDIR`` inside the scratch tree so that any file
written anywhere the account may write shows up in the listing.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from broker.config import load_settings
from tests.support.processes import ROOT

ACCOUNT = "broker-nonroot"
IMAGE = "sha256:" + "ab" * 32
# Where the bug used to write (as root it succeeded): must stay as they were.
OUTSIDE = (Path("/dev/keys.db"), Path("/dev/kek.key"), Path("/x"), Path("/keys.db"))


@dataclass(frozen=True)
class Account:
    uid: int
    gid: int
    prefix: tuple[str, ...]  # runs a command as the account ((): we are the account)


def _account() -> Account:
    if os.geteuid() != 0:
        return Account(os.getuid(), os.getgid(), ())
    try:
        entry = pwd.getpwnam(ACCOUNT)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", ACCOUNT],
            check=True,
            capture_output=True,
        )
        entry = pwd.getpwnam(ACCOUNT)
    drop: tuple[str, ...] = (
        "setpriv", f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}", "--clear-groups"
    )  # fmt: skip
    spawn = "import broker, subprocess, sys; subprocess.run([sys.executable, '-V'], check=True)"
    probe = subprocess.run([*drop, sys.executable, "-c", spawn], capture_output=True, check=False)
    if probe.returncode != 0:  # the interpreter lives under a private home (/root/.pyenv):
        # keep only the right to read and search directories; every write is still checked
        # against the account, which is what this test is about
        keep = "+dac_read_search"
        drop = (*drop, f"--inh-caps={keep}", f"--ambient-caps={keep}")
    return Account(entry.pw_uid, entry.pw_gid, drop)


@pytest.fixture(scope="module")
def account() -> Account:
    return _account()


@pytest.fixture
def scratch(account: Account) -> Iterator[Path]:
    """A directory tree the account owns (outside pytest's root-only temporary tree)."""
    base = Path(tempfile.mkdtemp(prefix="broker-paths-"))
    base.chmod(0o755)
    for name in ("home", "elsewhere", "tmp"):
        (base / name).mkdir()
    for path in (base, *base.iterdir()):
        os.chown(path, account.uid, account.gid)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def broker(account: Account, base: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    environ = {
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        "HOME": str(base / "home"),
        "TMPDIR": str(base / "tmp"),
        "PYTHONPATH": str(ROOT),
        "LANG": "C.UTF-8",
    }
    done = subprocess.run(
        [*account.prefix, sys.executable, "-m", "broker.cli", *args],
        cwd=cwd,
        env=environ,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, (args, done.stderr[-3000:])
    return done


def files_under(directory: Path) -> set[Path]:
    return {path for path in directory.rglob("*") if not path.is_dir()}


def outside_state() -> dict[Path, bool]:
    return {path: path.exists() for path in OUTSIDE}


def test_dev_init_and_demo_write_only_inside_their_directory_as_an_ordinary_user(
    account: Account, scratch: Path
) -> None:
    before = outside_state()
    home, elsewhere = scratch / "home", scratch / "elsewhere"
    broker(account, scratch, home, "dev", "init", "./dev", "--image", IMAGE)
    broker(account, scratch, home, "demo", "--workdir", "./x")
    workspace = home / "dev"
    # The same workspace read from another working directory: the same store and KEK.
    listed = broker(
        account, scratch, elsewhere, "keys", "list", "--config", str(workspace / "broker.toml")
    )
    assert '"models/dev"' in listed.stdout

    assert outside_state() == before
    written = files_under(scratch)
    inside = files_under(workspace) | files_under(home / "x")
    assert written - inside == set(), sorted(map(str, written - inside))
    assert {workspace / "keys.db", workspace / "kek.key"} <= inside
    assert {home / "x" / "keys.db", home / "x" / "kek.key"} <= inside
    owners = {path.stat().st_uid for path in inside}
    assert owners == {account.uid}  # written by the ordinary account, not by root

    text = (workspace / "broker.toml").read_text(encoding="utf-8")
    assert 'store = "sqlite:///keys.db"' in text  # relative: the workspace can move
    assert 'kek = "local:kek.key"' in text
    settings = load_settings(workspace / "broker.toml", {})
    assert settings.keys.store == f"sqlite:///{workspace.resolve() / 'keys.db'}"
    assert settings.keys.kek == f"local:{workspace.resolve() / 'kek.key'}"

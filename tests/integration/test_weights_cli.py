"""``broker weights encrypt | decrypt | inspect`` as a model owner runs them (subprocesses)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from broker.keys.admin import cli_actor
from tests.integration.conftest import write_config, write_statement_key
from tests.support.cli import Ran, run
from tests.support.issuers import dev_issuer

ROOT = Path(__file__).parents[2]


def broker(*args: str, env: dict[str, str] | None = None) -> Ran:
    return run(*args, env=env)


@pytest.fixture
def owner(tmp_path: Path) -> dict[str, Any]:
    config = write_config(tmp_path / "b", dev_issuer())
    created = broker(
        "keys", "create", "models/tiny", "--purpose", "model-weights", "--config", str(config)
    )
    assert created.returncode == 0, created.stderr
    model = tmp_path / "snapshot"
    (model / "nested").mkdir(parents=True)
    files = {
        "model-00001-of-00002.safetensors": os.urandom(300_001),
        "model-00002-of-00002.safetensors": b"",
        "nested/adapter.gguf": os.urandom(70_000),
        "config.json": b'{"architectures": ["Tiny"]}',
    }
    for name, data in files.items():
        (model / name).write_bytes(data)
    return {"config": config, "model": model, "files": files, "tmp": tmp_path}


def test_owner_encrypts_a_snapshot_inspects_and_decrypts_it(owner: dict[str, Any]) -> None:
    config, model, tmp = owner["config"], owner["model"], owner["tmp"]
    encrypted = tmp / "encrypted"
    done = broker(
        "weights",
        "encrypt",
        str(model),
        str(encrypted),
        "--key",
        "models/tiny",
        "--config",
        str(config),
        "--segment-size",
        "65536",
    )
    assert done.returncode == 0, done.stderr
    manifest = json.loads((encrypted / "manifest.json").read_text())
    assert manifest["kid"] == "models/tiny#1"
    assert sorted(e["path"] for e in manifest["files"]) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "nested/adapter.gguf",
    ]
    assert (encrypted / "config.json").read_bytes() == owner["files"]["config.json"]
    sealed = encrypted / "model-00001-of-00002.safetensors.brkw"
    assert owner["files"]["model-00001-of-00002.safetensors"][:64] not in sealed.read_bytes()
    assert oct(sealed.stat().st_mode & 0o777) == "0o600"

    inspected = broker("weights", "inspect", str(sealed))
    assert inspected.returncode == 0, inspected.stderr
    header = json.loads(inspected.stdout)
    assert (header["kid"], header["segments"], header["plaintext_size"]) == (
        "models/tiny#1",
        5,
        300_001,
    )

    whole = broker("weights", "inspect", str(encrypted))  # a directory: manifest, every header
    assert whole.returncode == 0, whole.stderr
    listing = json.loads(whole.stdout)
    assert listing["manifest"] == manifest
    assert [(f["path"], f["kid"]) for f in listing["files"]] == [
        (e["path"], "models/tiny#1") for e in manifest["files"]
    ]

    out = tmp / "decrypted"
    back = broker("weights", "decrypt", str(encrypted), str(out), "--config", str(config))
    assert back.returncode == 0, back.stderr
    for name, data in owner["files"].items():  # a loadable model directory, configs included
        assert (out / name).read_bytes() == data
    assert not (out / "manifest.json").exists()  # the encrypted form's manifest stays there
    records = [
        json.loads(line) for line in (config.parent / "decisions.log").read_text().splitlines()
    ]
    uses = [r for r in records if r.get("type") == "key_admin"]
    assert [r["action"] for r in uses[-3:]] == [  # every use of the DEK logged, and its end
        "weights-encrypt", "weights-decrypt", "weights-decrypt-result"
    ]  # fmt: skip
    assert uses[-1]["outcome"] == "ok"
    assert uses[-1]["bytes"] > 0
    assert {r["who"] for r in uses[-3:]} == {cli_actor()}
    assert broker("audit", "verify", str(config.parent / "decisions.log")).returncode == 0


def test_a_changed_file_is_refused_and_leaves_no_plaintext(owner: dict[str, Any]) -> None:
    config, model, tmp = owner["config"], owner["model"], owner["tmp"]
    single = model / "model-00001-of-00002.safetensors"
    sealed = tmp / "one.brkw"
    assert (
        broker(
            "weights",
            "encrypt",
            str(single),
            str(sealed),
            "--key",
            "models/tiny",
            "--config",
            str(config),
        ).returncode
        == 0
    )
    data = bytearray(sealed.read_bytes())
    data[200] ^= 0x80
    sealed.write_bytes(bytes(data))
    out = tmp / "out.safetensors"
    refused = broker("weights", "decrypt", str(sealed), str(out), "--config", str(config))
    assert refused.returncode == 1
    assert "does not authenticate" in refused.stderr
    assert not out.exists()
    assert not Path(f"{out}.partial").exists()
    records = [
        json.loads(line) for line in (config.parent / "decisions.log").read_text().splitlines()
    ]
    result = [r for r in records if r.get("action") == "weights-decrypt-result"][-1]
    assert result["outcome"] == "failed"  # a tampered file does not read as a success
    assert "does not authenticate" in result["problem"]


def test_disabled_or_query_keys_and_bad_input_are_refused(owner: dict[str, Any]) -> None:
    config, model, tmp = owner["config"], owner["model"], owner["tmp"]
    signing = {"BROKER_KEYS_SIGNING_KEY": str(write_statement_key(tmp / "statement.pem"))}
    created = broker(
        "keys", "create", "queries/q", "--purpose", "query", "--config", str(config), env=signing
    )
    assert created.returncode == 0, created.stderr
    query = broker(
        "weights",
        "encrypt",
        str(model),
        str(tmp / "q"),
        "--key",
        "queries/q",
        "--config",
        str(config),
    )
    assert query.returncode == 1
    assert "query key" in query.stderr
    assert (
        broker(
            "keys", "disable", "models/tiny", "--version", "1", "--config", str(config)
        ).returncode
        == 0
    )
    disabled = broker(
        "weights",
        "encrypt",
        str(model),
        str(tmp / "d"),
        "--key",
        "models/tiny",
        "--config",
        str(config),
    )
    assert disabled.returncode == 1
    assert "key_version_unavailable" in disabled.stderr
    assert not (tmp / "d").exists() or not any((tmp / "d").iterdir())
    empty = tmp / "empty"
    empty.mkdir()
    assert (
        broker(
            "weights",
            "encrypt",
            str(empty),
            str(tmp / "e"),
            "--key",
            "models/tiny",
            "--config",
            str(config),
        ).returncode
        == 2  # a directory without weights: a usage error naming it (issue 28)
    )
    not_brkw = broker("weights", "inspect", str(model / "config.json"))
    assert not_brkw.returncode == 2  # not a weights file: a usage error naming it (issue 28)
    assert "not a BRKW1" in not_brkw.stderr

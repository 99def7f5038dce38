"""``broker audit query`` / ``export`` select by instant, not by text, and refuse what they
cannot read: an empty answer must mean "no such records", never "your filter was garbage"."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from broker.audit.log import DecisionLog
from broker.cli import main as cli

TIMES = ["2026-11-22T23:30:00+00:00", "2026-11-23T00:30:00+00:00", "2026-11-23T02:00:00+00:00"]


@pytest.fixture
def log(tmp_path: Path) -> Path:
    path = tmp_path / "decisions.log"

    async def write() -> None:
        decisions = DecisionLog(path, replica="broker-0")
        await decisions.open()
        for index, when in enumerate(TIMES):
            result = "allow" if index == 1 else "deny"
            await decisions.append(
                {"type": "release", "time": when, "result": result, "key": "models/a",
                 "decision_id": f"d{index}"}
            )  # fmt: skip
        rotate = await decisions.append_entry(
            {"type": "key_admin", "time": "2026-11-22T08:00:00+00:00", "action": "rotate",
             "key": "models/a",
             "who": "token:0123456789ab"}
        )  # fmt: skip
        await decisions.append(
            {"type": "key_admin", "time": "2026-11-22T08:00:00+00:00", "action": "rotate",
             "key": "models/a", "who": "token:0123456789ab", "result": "unknown",
             "code": "key_store_unavailable", "intent": rotate.index}
        )  # fmt: skip
        await decisions.close()

    asyncio.run(write())
    return path


def query(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[dict[str, object]]]:
    code = cli.main(["audit", *args])
    out = capsys.readouterr().out
    return code, [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_since_compares_instants_across_zones(
    log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """+01:00 and Z for the same instant used to give 0 and 2 records (text comparison)."""
    _, in_utc = query(capsys, "query", str(log), "--since", "2026-11-23T00:00:00Z")
    _, in_cet = query(capsys, "query", str(log), "--since", "2026-11-23T01:00:00+01:00")
    assert [r["decision_id"] for r in in_utc] == ["d1", "d2"]
    assert in_cet == in_utc
    _, window = query(
        capsys, "query", str(log), "--since", "2026-11-23T00:00:00Z",
        "--until", "2026-11-23T01:00:00Z",
    )  # fmt: skip
    assert [r["decision_id"] for r in window] == ["d1"]
    _, exported = query(
        capsys, "export", str(log), "--format", "jsonl", "--since", "2026-11-23T01:00:00+01:00"
    )
    assert [r["decision_id"] for r in exported] == ["d1", "d2"]


@pytest.mark.parametrize(
    ("arguments", "says"),
    [
        (["--since", "yesterday"], "not an RFC 3339 time: 'yesterday'"),
        (["--since", "2026-11-23T00:00:00"], "has no zone"),  # which instant?
        (["--until", "2026-13-01T00:00:00Z"], "not an RFC 3339 time"),
        (["--result", "denied"], "invalid choice: 'denied'"),  # the value is "deny"
    ],
)
def test_unreadable_filters_are_refused_not_empty(
    log: Path, capsys: pytest.CaptureFixture[str], arguments: list[str], says: str
) -> None:
    with pytest.raises(SystemExit) as caught:
        cli.main(["audit", "query", str(log), *arguments])
    assert caught.value.code == 2
    assert says in capsys.readouterr().err


def test_filters_by_result_decision_replica_and_who(
    log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, denied = query(capsys, "query", str(log), "--result", "deny")
    assert [r["decision_id"] for r in denied] == ["d0", "d2"]
    _, one = query(capsys, "query", str(log), "--decision", "d1", "--replica", "broker-0")
    assert [r["decision_id"] for r in one] == ["d1"]
    _, none = query(capsys, "query", str(log), "--replica", "broker-1")
    assert none == []
    _, by_token = query(capsys, "query", str(log), "--who", "token:0123456789ab")
    assert [(r["type"], r["action"]) for r in by_token] == [("key_admin", "rotate")] * 2
    _, unknown = query(capsys, "query", str(log), "--result", "unknown")  # key changes only
    assert [(r["action"], r["result"], r["code"]) for r in unknown] == [
        ("rotate", "unknown", "key_store_unavailable")
    ]
    _, nobody = query(capsys, "query", str(log), "--who", "alice@host")
    assert nobody == []

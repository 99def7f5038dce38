"""schemathesis against a live broker on loopback: generated requests for every operation in
/openapi.json; any 5xx, or any response that does not match the description, fails."""

from __future__ import annotations

import asyncio
import hashlib
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import write_statement_key
from tests.integration.hostile import ADMIN_TOKEN

CHECKS = ",".join(
    [
        "not_a_server_error",
        "status_code_conformance",
        "content_type_conformance",
        "response_schema_conformance",
        "response_headers_conformance",
    ]
)
SCHEMATHESIS = Path(sys.executable).parent / "schemathesis"


# Each schemathesis run is time-boxed at 45 s (at most two runs); start-up and shrinking add.
@pytest.mark.timeout(300)
async def test_schemathesis_finds_no_server_error_or_schema_violation(
    start_broker: Any, tmp_path: Path
) -> None:
    signing_key = write_statement_key(tmp_path / "statement.key")
    broker = await start_broker(
        environ={
            "BROKER_ADMIN_TOKEN_SHA256": hashlib.sha256(ADMIN_TOKEN.encode()).hexdigest(),
            "BROKER_KEYS_SIGNING_KEY": str(signing_key),
        }
    )
    # A run that fails only because hypothesis itself crashed (a "Runtime Error" raised inside
    # hypothesis's engine, no check failed) says nothing about the broker: run once more with
    # the next seed. Seen with hypothesis 6.170.17, whose target-optimisation pass can index
    # past the end of a shorter attempt (IndexError in optimiser.hill_climb) depending on timing.
    # Any check failure, or any other error, fails at once; the last run must exit 0 either way.
    for seed in (20261130, 20261131):
        returncode, text = await run_schemathesis(broker, seed)
        if returncode == 0 or not hypothesis_crashed(text):
            break
        print(f"schemathesis: hypothesis crashed internally with seed {seed}; running again")
    summary = [line for line in text.splitlines() if "passed" in line or "failed" in line]
    print("schemathesis:", *summary[-3:], sep="\n")
    assert returncode == 0, text[-6000:]


async def run_schemathesis(broker: Any, seed: int) -> tuple[int, str]:
    run = await asyncio.create_subprocess_exec(
        str(SCHEMATHESIS),
        "run",
        f"{broker.url}/openapi.json",
        "--checks",
        CHECKS,
        "--tls-verify",
        str(broker.workdir / "tls" / "ca.pem"),
        "--header",
        f"Authorization: Bearer {ADMIN_TOKEN}",
        "--max-examples",
        "40",
        "--seed",
        str(seed),
        "--phases",
        "examples,coverage,fuzzing",
        "--request-timeout",
        "10",
        "--max-time",
        "45",
        # One worker: with two threads, hypothesis's concurrent ast.parse trips a CPython 3.11
        # bug ("SystemError: AST constructor recursion depth mismatch", gh-106905) that fails the
        # run for reasons that have nothing to do with the broker.
        "--workers",
        "1",
        # The key-name path pattern (`[a-z0-9][a-z0-9._/-]*`) makes hypothesis discard many
        # generated paths; its "filter_too_much" health check then fails the run on some seeds
        # although the broker answered every request it sent (a generator limit, not a finding).
        "--suppress-health-check",
        "filter_too_much",
        "--no-color",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await run.communicate()
    assert run.returncode is not None
    return run.returncode, out.decode(errors="replace")


def hypothesis_crashed(text: str) -> bool:
    """True when the run's only problems are runtime errors raised inside hypothesis's engine."""
    if re.search(r"=+ FAILURES =+", text):
        return False
    parts = re.split(r"=+ ERRORS =+", text, maxsplit=1)
    if len(parts) != 2:
        return False
    section = re.split(r"=+ (?:WARNINGS|SUMMARY) =+", parts[1], maxsplit=1)[0]
    blocks = re.split(r"\n_{3,} .+ _{3,}\n", section)[1:]
    return bool(blocks) and all(
        "Runtime Error" in block and "/hypothesis/internal/conjecture/" in block for block in blocks
    )

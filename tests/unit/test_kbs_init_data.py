"""A guest's init-data (``kbs/init_data.py``): read as Trustee reads it (TOML with version,
algorithm, data) and accepted only when its digest, with the algorithm it declares, is the
evidence's launch field as guest-components' attesters bind it: TDX MRCONFIGID (48 bytes) and
SEV-SNP HOST_DATA (32), the digest zero-padded or truncated to the field."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from broker.core.errors import AttestationError, ErrorCode, InputError
from broker.kbs.init_data import bind_init_data, parse_init_data

AA_TOML = '[token_configs.kbs]\nurl = "https://broker.example:8443"\n'


def document(algorithm: str = "sha384", extra: str = "") -> str:
    """An init-data document as kata hands it to the guest (``kbs/docs/initdata.md``)."""
    head = f'algorithm = "{algorithm}"\nversion = "0.1.0"\n{extra}\n'
    return head + "[data]\n\"aa.toml\" = '''\n" + AA_TOML + "'''\n"


def init(body: str) -> dict[str, Any]:
    return {"format": "toml", "body": body}


@pytest.mark.parametrize(
    ("algorithm", "size", "field"),
    [
        ("sha384", 48, "mrconfigid"),  # the usual TDX case: the digest fills the field
        ("sha256", 48, "mrconfigid"),  # shorter: zero-padded
        ("sha512", 48, "mrconfigid"),  # longer: truncated
        ("sha256", 32, "host_data"),  # the usual SNP case
        ("sha384", 32, "host_data"),
    ],
)
def test_init_data_binds_as_the_attesters_bind_it(algorithm: str, size: int, field: str) -> None:
    body = document(algorithm)
    digest = hashlib.new(algorithm, body.encode()).digest()
    parsed = parse_init_data(init(body))
    assert parsed is not None
    assert (parsed.algorithm, parsed.digest) == (algorithm, digest)
    value = digest[:size].ljust(size, b"\0")  # what the host set at launch
    verified = bind_init_data(parsed, (field, value))
    assert verified is not None
    assert verified.as_claims() == {"algorithm": algorithm, "digest": digest.hex(), "field": field}


@pytest.mark.parametrize("field", [("mrconfigid", bytes(48)), ("host_data", bytes(32))])
def test_init_data_of_another_launch_refused(field: tuple[str, bytes]) -> None:
    parsed = parse_init_data(init(document()))
    other = hashlib.sha384(document("sha384", extra='x = "1"').encode()).digest()
    for value in (field[1], other[: len(field[1])]):  # unset (zeros), or another document's
        with pytest.raises(AttestationError) as caught:
            bind_init_data(parsed, (field[0], value))
        assert caught.value.code is ErrorCode.KBS_INIT_DATA_MISMATCH
        assert field[0] in caught.value.message


def test_no_init_data_or_no_field_binds_nothing() -> None:
    """No init-data sent: accepted whatever the field holds (a guest given only the digest
    cannot send the document; the policy pins the field). Evidence without a field (sample):
    nothing is bound, so the policy sees none."""
    assert bind_init_data(None, ("mrconfigid", b"\x01" * 48)) is None
    assert bind_init_data(parse_init_data(init(document())), None) is None
    assert parse_init_data(None) is None


@pytest.mark.parametrize(
    "unverified",
    [
        {"format": "json", "body": document()},  # Trustee reads toml only
        {"format": "toml"},
        {"format": "toml", "body": document(), "more": 1},
        init("not = toml = at all"),
        init('version = "0.1.0"\n[data]\n'),  # no algorithm
        init(document("md5")),  # an algorithm guests do not know
        init('algorithm = "sha384"\n[data]\n'),  # no version
        init('algorithm = "sha384"\nversion = "0.1.0"\n'),  # no data
        init('algorithm = "sha384"\nversion = "0.1.0"\n[data]\nx = 1\n'),  # data not strings
        init(document() + "\ud800"),  # no UTF-8 form
        init("a = " + "[" * 5000 + "]" * 5000),  # nesting deeper than the parser recurses
        {"format": "toml", "body": 1},
        "toml",
    ],
)
def test_malformed_init_data_refused_at_parse(unverified: Any) -> None:
    with pytest.raises(InputError) as caught:
        parse_init_data(unverified)
    assert caught.value.code is ErrorCode.BAD_REQUEST

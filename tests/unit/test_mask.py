"""Masking the policy input in decision records (``[audit] mask`` and the policy's own masks)."""

from __future__ import annotations

import copy
import hashlib
import hmac
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from broker.audit.mask import load_or_create_mask_key, masked
from broker.core.encoding import canonical
from broker.core.errors import ConfigError

KEY = bytes(range(32))


def digest(value: object) -> str:
    return "hmac-sha256:" + hmac.new(KEY, canonical(value), hashlib.sha256).hexdigest()


DOCUMENT: dict[str, Any] = {
    "claims": {"gca": {"sub": "runner@example", "aud": "b"}, "other": [1, {"x": None}]},
    "a/b": {"m~n": "slashes and tildes"},
    "key": "models/a",
}


def test_values_at_pointers_are_replaced_by_their_digest_and_the_input_is_untouched() -> None:
    before = copy.deepcopy(DOCUMENT)
    result = masked(DOCUMENT, ["/claims/gca/sub", "/claims/other/1/x", "/a~1b/m~0n"], KEY)
    assert before == DOCUMENT  # copy on write: the caller's input never changes
    assert result["claims"]["gca"] == {"sub": digest("runner@example"), "aud": "b"}
    assert result["claims"]["other"] == [1, {"x": digest(None)}]
    assert result["a/b"] == {"m~n": digest("slashes and tildes")}
    assert result["key"] == "models/a"


def test_whole_subtrees_and_list_items_can_be_masked() -> None:
    result = masked(DOCUMENT, ["/claims/gca", "/claims/other/0"], KEY)
    assert result["claims"]["gca"] == digest({"sub": "runner@example", "aud": "b"})
    assert result["claims"]["other"][0] == digest(1)


def test_missing_or_malformed_pointers_change_nothing() -> None:
    for pointers in (["/nope/x"], ["/claims/other/9"], ["claims"], ["/key/deeper"], []):
        assert masked(DOCUMENT, pointers, KEY) == DOCUMENT


def test_unmasked_parts_are_shared_not_copied() -> None:
    result = masked(DOCUMENT, ["/claims/gca/sub"], KEY)
    assert result["a/b"] is DOCUMENT["a/b"]  # nothing deep is copied without a reason
    assert result["claims"]["other"] is DOCUMENT["claims"]["other"]
    assert result["claims"] is not DOCUMENT["claims"]


def test_low_entropy_value_cannot_be_confirmed_by_hashing_a_guess() -> None:
    """A plain SHA-256 let anyone with the log confirm a guessed e-mail; the HMAC does not."""
    result = masked(DOCUMENT, ["/claims/gca/sub"], KEY)["claims"]["gca"]["sub"]
    guess = "sha256:" + hashlib.sha256(canonical("runner@example")).hexdigest()
    assert result != guess
    assert result.removeprefix("hmac-sha256:") != guess.removeprefix("sha256:")
    assert masked(DOCUMENT, ["/claims/gca/sub"], bytes(32))["claims"]["gca"]["sub"] != result


def test_mask_key_is_created_once_private_and_reused(tmp_path: Path) -> None:
    path = tmp_path / "state" / "mask.key"
    first = load_or_create_mask_key(path)
    assert len(first) == 32
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert load_or_create_mask_key(path) == first
    path.write_bytes(b"short")
    with pytest.raises(ConfigError):
        load_or_create_mask_key(path)

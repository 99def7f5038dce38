"""Masking the policy input in decision records (``[audit] mask`` and the policy's own masks)."""

from __future__ import annotations

import copy
import hashlib

from broker.audit.log import canonical
from broker.audit.mask import masked


def digest(value: object) -> str:
    return "sha256:" + hashlib.sha256(canonical(value)).hexdigest()


DOCUMENT = {
    "claims": {"gca": {"sub": "runner@example", "aud": "b"}, "other": [1, {"x": None}]},
    "a/b": {"m~n": "slashes and tildes"},
    "key": "models/a",
}


def test_values_at_pointers_are_replaced_by_their_digest_and_the_input_is_untouched() -> None:
    before = copy.deepcopy(DOCUMENT)
    result = masked(DOCUMENT, ["/claims/gca/sub", "/claims/other/1/x", "/a~1b/m~0n"])
    assert before == DOCUMENT  # copy on write: the caller's input never changes
    assert result["claims"]["gca"] == {"sub": digest("runner@example"), "aud": "b"}
    assert result["claims"]["other"] == [1, {"x": digest(None)}]
    assert result["a/b"] == {"m~n": digest("slashes and tildes")}
    assert result["key"] == "models/a"


def test_whole_subtrees_and_list_items_can_be_masked() -> None:
    result = masked(DOCUMENT, ["/claims/gca", "/claims/other/0"])
    assert result["claims"]["gca"] == digest({"sub": "runner@example", "aud": "b"})
    assert result["claims"]["other"][0] == digest(1)


def test_missing_or_malformed_pointers_change_nothing() -> None:
    for pointers in (["/nope/x"], ["/claims/other/9"], ["claims"], ["/key/deeper"], []):
        assert masked(DOCUMENT, pointers) == DOCUMENT


def test_unmasked_parts_are_shared_not_copied() -> None:
    result = masked(DOCUMENT, ["/claims/gca/sub"])
    assert result["a/b"] is DOCUMENT["a/b"]  # nothing deep is copied without a reason
    assert result["claims"]["other"] is DOCUMENT["claims"]["other"]
    assert result["claims"] is not DOCUMENT["claims"]

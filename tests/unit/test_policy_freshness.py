"""TUF's rule for policy bundles, as pure checks and the replica's floor on disk
(``broker.policy.freshness``); the deployed behaviour is in
``tests/integration/test_policy_freshness.py``."""

from __future__ import annotations

import threading
from datetime import UTC, datetime
from pathlib import Path

import pytest

from broker.policy.freshness import (
    CorruptState,
    DowngradeTarget,
    Freshness,
    FreshnessState,
    FreshnessStore,
    StaleBundle,
    check,
    claims_of,
    logged_floor,
    merged,
)
from broker.policy.wasm import PolicyLoadError

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
LATER = int(NOW.timestamp()) + 3600


def test_rollback_below_the_floor_is_refused() -> None:
    with pytest.raises(StaleBundle, match="version 4 is older than version 5"):
        check(Freshness(4, LATER), FreshnessState(5, 5), now=NOW, source="s")
    check(Freshness(5, LATER), FreshnessState(5, 5), now=NOW, source="s")  # the same: reload
    check(Freshness(6, LATER), FreshnessState(5, 5), now=NOW, source="s")


def test_expired_bundle_is_refused_even_on_a_deliberate_downgrade() -> None:
    expired = Freshness(9, int(NOW.timestamp()))
    for target in (None, DowngradeTarget(9)):
        with pytest.raises(StaleBundle, match="expired at 2026-12-02T12:00:00"):
            check(expired, FreshnessState(1, 1), now=NOW, downgrade=target, source="s")


def test_versions_rolled_back_from_stay_refused_after_a_downgrade(tmp_path: Path) -> None:
    store = FreshnessStore(tmp_path / "log.policy")
    store.advance(Freshness(5, LATER), b"v5", "sha:5")
    check(Freshness(3, LATER), store.read(), now=NOW, downgrade=DowngradeTarget(3), source="s")
    state = store.advance(Freshness(3, LATER), b"v3", "sha:3", downgrade=("token:ab", "INC-1"))
    assert (state.version, state.highest, state.downgraded_by) == (3, 5, "token:ab")
    assert store.cached() == b"v3"
    for withdrawn in (4, 5):
        with pytest.raises(StaleBundle, match="rolled back from"):
            check(Freshness(withdrawn, LATER), store.read(), now=NOW, source="s")
    check(Freshness(6, LATER), store.read(), now=NOW, source="s")


def test_floor_never_lowers_without_a_downgrade(tmp_path: Path) -> None:
    """Two workers finishing loads out of order: the later, lower one does not lower it."""
    store = FreshnessStore(tmp_path / "log.policy")
    store.advance(Freshness(7, LATER), b"v7", "sha:7")
    state = store.advance(Freshness(6, LATER), b"v6", "sha:6")
    assert (state.version, state.highest, state.bundle_sha256) == (7, 7, "sha:7")
    assert store.cached() == b"v7"  # the cache keeps the bundle the floor names


def test_floor_survives_a_restart(tmp_path: Path) -> None:
    FreshnessStore(tmp_path / "p").advance(Freshness(3, LATER), b"v3", "sha:3")
    assert FreshnessStore(tmp_path / "p").read().version == 3


@pytest.mark.parametrize(
    "claims",
    [{}, {"policy_version": 2}, {"policy_version": True, "policy_expires": LATER},
     {"policy_version": "2", "policy_expires": LATER}, {"policy_version": 0, "policy_expires": 1},
     {"policy_version": 2, "policy_expires": 1.5}],
)  # fmt: skip
def test_signed_bundle_without_usable_freshness_claims_is_refused(
    claims: dict[str, object],
) -> None:
    with pytest.raises(PolicyLoadError, match="no usable policy_"):
        claims_of(claims, source="s")


def test_one_refusal_record_per_bundle_whichever_worker_meets_it_first(tmp_path: Path) -> None:
    directory = tmp_path / "log.policy"
    firsts: list[bool] = []
    lock = threading.Lock()

    def worker() -> None:
        first = FreshnessStore(directory).first_refusal("sha256:aa")
        with lock:
            firsts.append(first)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(firsts) == [False] * 7 + [True]
    assert FreshnessStore(directory).first_refusal("sha256:bb") is True


def test_a_version_names_one_bundle_other_bytes_under_the_floor_version_are_refused() -> None:
    state = FreshnessState(5, 5, bundle_sha256="sha256:aa")
    with pytest.raises(StaleBundle, match="version 5 is already in force with other bytes"):
        check(Freshness(5, LATER), state, now=NOW, sha256="sha256:bb", source="s")
    check(Freshness(5, LATER), state, now=NOW, sha256="sha256:aa", source="s")  # the same bytes


def test_downgrade_loads_only_the_bundle_it_names() -> None:
    state = FreshnessState(5, 5, bundle_sha256="sha256:aa")
    with pytest.raises(StaleBundle, match="the downgrade names version 3; the source serves "
                       "version 4"):  # fmt: skip
        check(Freshness(4, LATER), state, now=NOW, downgrade=DowngradeTarget(3), source="s")
    named = DowngradeTarget(3, "sha256:cc")
    with pytest.raises(StaleBundle, match="the downgrade names bundle sha256:cc"):
        check(Freshness(3, LATER), state, now=NOW, sha256="sha256:dd", downgrade=named, source="s")
    check(Freshness(3, LATER), state, now=NOW, sha256="sha256:cc", downgrade=named, source="s")


@pytest.mark.parametrize(
    "content",
    [b'{"version": "7", "highest": 7}', b'{"version": 7, "highest": null}', b"[7]", b"{7",
     b'{"version": true}', b'{"version": 7, "bundle_sha256": 7}'],
)  # fmt: skip
def test_corrupt_state_file_is_reported_corrupt_never_compared(
    tmp_path: Path, content: bytes
) -> None:
    """A non-integer version once reached ``check`` and raised TypeError in the watch task."""
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "state.json").write_bytes(content)
    with pytest.raises(CorruptState):
        FreshnessStore(tmp_path / "p").read_state()
    assert FreshnessStore(tmp_path / "p").read() == FreshnessState()


def test_lost_state_file_does_not_lower_the_floor_below_the_logs_last_version() -> None:
    logged = logged_floor({"type": "policy_change", "version": 4, "bundle_sha256": "sha256:aa"})
    assert logged == FreshnessState(4, 4, "sha256:aa")
    floor = merged(FreshnessState(), logged)
    with pytest.raises(StaleBundle, match="version 3 is older than version 4"):
        check(Freshness(3, LATER), floor, now=NOW, source="s")
    with pytest.raises(StaleBundle, match="other bytes"):
        check(Freshness(4, LATER), floor, now=NOW, sha256="sha256:bb", source="s")
    kept = FreshnessState(6, 8, "sha256:cc")  # a state above the log's (a newer load) stays
    assert merged(kept, logged) is kept
    assert logged_floor({"type": "policy_change", "new_digest": "d"}) is None  # a directory
    assert logged_floor(None) is None

"""``/readyz``'s verdict on the background checks' last round (``api/readiness.py``).

State a background task keeps can go stale: if the task is stuck or gone, a broker must not keep
saying "ready" from an old round. Failing stores are ``not_ready``; a failing policy source with
the last good policy serving is ``degraded``.
"""

from __future__ import annotations

from broker.api.readiness import HealthRound, judge

STALE_AFTER = 25.0
LIVE: dict[str, object] = {"policy": "sha256:" + "ab" * 32}


def round_at(taken: float, **fields: tuple[str, ...]) -> HealthRound:
    return HealthRound(
        taken=taken,
        checked_at="2026-12-02T11:00:00+00:00",
        checks={"key_store": "ok", "nonce_store": "ok"},
        **fields,
    )


def test_a_fresh_clean_round_is_ready() -> None:
    report = judge(round_at(100.0), 104.0, STALE_AFTER, LIVE)
    assert (report.status, report.problems, report.age_seconds) == ("ready", (), 4.0)
    assert report.checks == {**LIVE, "key_store": "ok", "nonce_store": "ok"}


def test_stale_health_state_is_not_ready() -> None:
    """A stuck or dead background task: the last round said ready, long ago."""
    report = judge(round_at(100.0), 100.0 + STALE_AFTER + 0.5, STALE_AFTER, LIVE)
    assert report.status == "not_ready"
    assert report.problems == ("the health checks have not run for 25 s",)


def test_no_round_at_all_is_not_ready() -> None:
    report = judge(None, 0.0, STALE_AFTER, LIVE)
    assert report.status == "not_ready"
    assert report.age_seconds == -1.0


def test_failing_policy_source_is_degraded_not_down() -> None:
    warned = round_at(100.0, warnings=("the policy source fails",))
    assert judge(warned, 101.0, STALE_AFTER, LIVE).status == "degraded"
    both = round_at(100.0, warnings=("the policy source fails",), problems=("key store",))
    assert judge(both, 101.0, STALE_AFTER, LIVE).status == "not_ready"  # a problem outranks

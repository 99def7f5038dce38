"""The broker's token buckets (``core/buckets.py``): a burst, then the rate; a clock that steps
back refills nothing; the table of names stays bounded."""

from __future__ import annotations

from broker.core.buckets import TokenBuckets


def test_a_burst_then_the_rate() -> None:
    buckets = TokenBuckets(rate=2.0, burst=3)
    assert [buckets.wait_for("a", 100.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert buckets.wait_for("a", 100.0) == 0.5  # one token per half second
    assert buckets.wait_for("b", 100.0) == 0.0  # every name has its own bucket
    assert buckets.wait_for("a", 100.5) == 0.0
    assert buckets.wait_for("a", 100.5) > 0


def test_a_clock_that_steps_back_refills_nothing() -> None:
    buckets = TokenBuckets(rate=1.0, burst=1)
    assert buckets.wait_for("a", 100.0) == 0.0
    assert buckets.wait_for("a", 50.0) > 0  # not a refill of 50 s the other way
    assert buckets.wait_for("a", 99.0) > 0  # nor later, until the bucket's own time has passed
    assert buckets.wait_for("a", 101.0) == 0.0


def test_the_table_of_names_is_bounded() -> None:
    buckets = TokenBuckets(rate=1.0, burst=1, max_names=2)
    for name in ("a", "b", "c"):
        assert buckets.wait_for(name, 0.0) == 0.0
    assert len(buckets._buckets) == 2  # the bound under test
    assert buckets.wait_for("a", 0.0) == 0.0  # forgotten: a full bucket again

"""Client-side adaptive throttling (pure)."""

from __future__ import annotations

from random import Random

import pytest

from irismesh._core.throttle import MIN_REQUESTS, Throttle


def test_a_cluster_that_accepts_everything_is_never_throttled() -> None:
    throttle, rng = Throttle(), Random(1)
    for i in range(1000):
        assert throttle.admit("db", i * 0.001, rng)
        throttle.accepted("db", i * 0.001)
    assert throttle.probability("db") == 0.0


def test_a_few_failures_never_throttle() -> None:
    throttle, rng = Throttle(), Random(2)
    for i in range(int(MIN_REQUESTS) - 1):
        throttle.refused("db", i * 0.01)
    assert throttle.probability("db") == 0.0
    assert all(throttle.admit("db", 1.0, rng) for _ in range(100))


def test_a_saturated_cluster_gets_about_k_times_what_it_accepts() -> None:
    throttle, rng = Throttle(k=2.0), Random(3)
    sent = accepted = 0
    free_at = 0.0
    # The cluster accepts one request per 5 ms (200/s); the caller offers 1,000/s for 20 s.
    for i in range(20_000):
        now = i * 0.001
        if throttle.admit("db", now, rng):
            sent += 1
            if now >= free_at:
                free_at = now + 0.005
                accepted += 1
                throttle.accepted("db", now)
            else:
                throttle.refused("db", now)
    # Without throttling all 20,000 would go; with it about K x accepts, while the cluster
    # stays busy (arrivals at random leave some of its slots unused).
    assert accepted >= 0.6 * 4000
    assert 1.5 * accepted < sent < 2.5 * accepted
    assert sent < 0.4 * 20_000
    assert throttle.probability("other") == 0.0


def test_throttling_fades_once_the_cluster_accepts_again() -> None:
    throttle, rng = Throttle(window=1.0), Random(4)
    for i in range(200):
        throttle.refused("db", i * 0.001)
    assert throttle.probability("db") > 0.9
    for i in range(200):
        now = 1.0 + i * 0.05
        if throttle.admit("db", now, rng):
            throttle.accepted("db", now)
    assert throttle.probability("db") == 0.0


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="k >= 1"):
        Throttle(k=0.5)
    with pytest.raises(ValueError, match="positive window"):
        Throttle(window=0)


def test_a_cluster_that_stops_refusing_is_no_longer_throttled_a_moment_later() -> None:
    throttle, rng = Throttle(), Random(5)
    for i in range(1000):  # a long overload: most requests refused
        now = i * 0.001
        if throttle.admit("db", now, rng):
            if i % 10:
                throttle.refused("db", now)
            else:
                throttle.accepted("db", now)
    assert throttle.probability("db") > 0.5
    # The overload ends at 1 s: whatever is sent is answered. A second later nothing is
    # rejected here any more, though the decayed counts alone would still say so.
    rejected_late = 0
    for i in range(2000):
        now = 1.0 + i * 0.001
        if throttle.admit("db", now, rng):
            throttle.accepted("db", now)
        elif now > 2.0 + 0.001:
            rejected_late += 1
    assert rejected_late == 0

"""The proxy's token bucket per caller."""

from __future__ import annotations

import pytest

from proxy.api.ratelimit import RateLimiter


def test_a_burst_then_the_rate_and_the_wait_until_the_next_request() -> None:
    now = [0.0]
    limiter = RateLimiter(rate=2.0, burst=3, clock=lambda: now[0])
    assert [limiter.take("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limiter.take("a") == pytest.approx(0.5)  # empty: one token comes back in 1/rate seconds
    assert limiter.take("b") == 0.0  # another caller has its own bucket
    now[0] = 0.5
    assert limiter.take("a") == 0.0
    assert limiter.take("a") == pytest.approx(0.5)
    now[0] = 100.0  # refills up to the burst, not beyond
    assert [limiter.take("a") for _ in range(4)][-1] > 0


def test_it_keeps_a_bounded_number_of_callers_dropping_idle_ones_first() -> None:
    now = [0.0]
    limiter = RateLimiter(rate=1.0, burst=1, clock=lambda: now[0], max_keys=4)
    for k in "abcd":
        limiter.take(k)
    now[0] = 0.5
    limiter.take("a")  # still empty after half a second (refused): a is busy, b-d are too
    now[0] = 10.0  # all have refilled: any may go without losing anything
    limiter.take("e")
    assert len(limiter._buckets) <= 4
    with pytest.raises(ValueError):
        RateLimiter(rate=0, burst=1)

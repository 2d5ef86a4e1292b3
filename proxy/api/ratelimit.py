"""Rate limits on the generation endpoints: a token bucket per caller.

The caller is the API key it presents (``Authorization: Bearer``, once checked), or its address
when the proxy has no API key (a header anyone may vary would let a caller escape its limit). A
bucket holds up to ``burst`` requests and refills at ``rate`` per second; a request that finds it
empty gets 429 (OpenAI's ``rate_limit_exceeded``) with ``Retry-After`` set to when a request will
be let through again. Each proxy worker keeps its own buckets (with ``--workers N`` a caller may
get up to N times the rate).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Bucket:
    tokens: float
    at: float  # when ``tokens`` was computed (monotonic)


class RateLimiter:
    """Token buckets per key; at most ``max_keys`` are kept (full, idle buckets are dropped first)."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic,
                 max_keys: int = 100_000) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError(f"rate must be > 0 and burst >= 1, got {rate}, {burst}")
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._max_keys = max_keys
        self._buckets: dict[str, _Bucket] = {}

    def take(self, key: str) -> float:
        """Take one request from ``key``'s bucket: 0.0 if allowed, else the seconds until it would be."""
        now = self._clock()
        b = self._buckets.get(key)
        if b is None:
            if len(self._buckets) >= self._max_keys:
                self._prune(now)
            b = self._buckets[key] = _Bucket(float(self.burst), now)
        else:
            b.tokens = min(float(self.burst), b.tokens + (now - b.at) * self.rate)
            b.at = now
        if b.tokens >= 1.0:
            b.tokens -= 1.0
            return 0.0
        return (1.0 - b.tokens) / self.rate

    def _prune(self, now: float) -> None:
        """Drop the buckets that have refilled (their callers are idle: nothing is lost), else the oldest."""
        full = [k for k, b in self._buckets.items() if b.tokens + (now - b.at) * self.rate >= self.burst]
        for k in full or sorted(self._buckets, key=lambda k: self._buckets[k].at)[: len(self._buckets) // 2]:
            del self._buckets[k]

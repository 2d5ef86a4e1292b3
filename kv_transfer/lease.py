"""Sender side: a finished prefill's KV blocks held under a lease until the decode side is done.

The prefill engine keeps the blocks (``hold_kv``); the lease table frees them through the engine's
``release`` on confirmation, on abort, or when the lease expires (default 30 s), whichever comes
first, so blocks are never stranded by a decode side that vanished. ``expire`` is called by the
node's loop; the clock is injectable for tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_LEASE_S = 30.0


@dataclass
class Lease:
    request_id: str
    deadline: float


class LeaseTable:
    def __init__(
        self,
        release: Callable[[str], bool],
        lease_s: float = DEFAULT_LEASE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self._release = release
        self.lease_s = lease_s
        self._clock = clock
        self._leases: dict[str, Lease] = {}
        self.expired_total = 0

    def __len__(self) -> int:
        return len(self._leases)

    def hold(self, request_id: str, lease_s: float | None = None) -> Lease:
        if request_id in self._leases:
            raise ValueError(f"request {request_id!r} already holds a lease")
        lease = Lease(request_id, self._clock() + (lease_s if lease_s is not None else self.lease_s))
        self._leases[request_id] = lease
        return lease

    def _end(self, request_id: str) -> bool:
        if self._leases.pop(request_id, None) is None:
            return False
        self._release(request_id)
        return True

    def confirm(self, request_id: str) -> bool:
        """The decode side has the KV: free the blocks."""
        return self._end(request_id)

    def abort(self, request_id: str) -> bool:
        """The request was cancelled: free the blocks."""
        return self._end(request_id)

    def expire(self) -> list[str]:
        """Free every lease past its deadline; returns their request ids."""
        now = self._clock()
        gone = [rid for rid, lease in self._leases.items() if lease.deadline <= now]
        for rid in gone:
            self._end(rid)
        self.expired_total += len(gone)
        return gone

"""An in-process transport for tests: real byte copies between registered memory, with faults.

All endpoints of one ``Fabric`` live in one process. Copies are bounds-checked against the
registered regions of both sides (nothing outside registered memory is ever touched), then done
with ``ctypes.memmove``. Faults are set on the fabric, never in production code paths:
``kill(endpoint)`` (the peer is gone), ``fail_next(endpoint, cause)`` (the next batch touching it
fails), ``delay_s`` (every batch takes this long; past its timeout it fails with ``timeout``).
"""

from __future__ import annotations

import ctypes
import time

from kv_transfer.layout import CacheLayout
from kv_transfer.transport import Segment, TransferError, Transport


class Fabric:
    def __init__(self) -> None:
        self.endpoints: dict[str, FakeTransport] = {}
        self.dead: set[str] = set()
        self.failures: dict[str, str] = {}
        self.delay_s = 0.0
        self.bytes_moved = 0

    def transport(self, endpoint: str) -> FakeTransport:
        if endpoint in self.endpoints:
            raise ValueError(f"endpoint {endpoint!r} already exists")
        t = FakeTransport(self, endpoint)
        self.endpoints[endpoint] = t
        return t

    def kill(self, endpoint: str) -> None:
        self.dead.add(endpoint)

    def fail_next(self, endpoint: str, cause: str) -> None:
        self.failures[endpoint] = cause


class FakeTransport(Transport):
    def __init__(self, fabric: Fabric, endpoint: str) -> None:
        self.fabric = fabric
        self.endpoint = endpoint
        self._regions: list[tuple[int, int]] = []  # (start, end) addresses

    def register(self, layout: CacheLayout) -> None:
        for r in layout.regions.values():
            self._regions.append((r.base, r.base + r.num_blocks * r.block_bytes))

    def _check(self, addr: int, n: int, who: str) -> None:
        t = self.fabric.endpoints.get(who)
        if t is None or not any(a <= addr and addr + n <= b for a, b in t._regions):
            raise TransferError("not_registered", f"[{addr:#x}, +{n}) is not registered memory of {who}")

    def _batch(self, peer: str, segments: list[Segment], timeout_s: float) -> None:
        f = self.fabric
        for who in (self.endpoint, peer):
            if who in f.dead or who not in f.endpoints:
                raise TransferError("peer_gone", f"{who} is gone")
            if who in f.failures:
                raise TransferError(f.failures.pop(who), f"injected on {who}")
        if f.delay_s:
            time.sleep(min(f.delay_s, timeout_s))
            if f.delay_s >= timeout_s:
                raise TransferError("timeout", f"batch to {peer} took longer than {timeout_s}s")
        for s in segments:
            self._check(s.local_addr, s.nbytes, self.endpoint)
            self._check(s.remote_addr, s.nbytes, peer)
        for s in segments:
            ctypes.memmove(s.local_addr, s.remote_addr, s.nbytes)
            f.bytes_moved += s.nbytes

    def read(self, peer: str, segments: list[Segment], timeout_s: float) -> None:
        self._batch(peer, segments, timeout_s)

    def close(self) -> None:
        self._regions = []
        self.fabric.endpoints.pop(self.endpoint, None)

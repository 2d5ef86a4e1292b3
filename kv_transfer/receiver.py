"""Decode side: pull one request's KV into blocks the decode engine allocated, with metrics.

``Receiver.fill(request, sources)`` returns the ``fill`` callback for
``LLMEngine.add_prefilled``: given the allocated blocks it arranges them (so copies coalesce),
plans, pulls from every source within the timeout, records the transfer, and returns the block
table. If anything fails it records the cause and raises; ``add_prefilled`` then frees the blocks,
so a failed transfer never leaves blocks behind on the decode side. (The prefill side frees its
own under its lease: ``kv_transfer.lease``.)
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

from kv_transfer.layout import CacheLayout, RequestKV
from kv_transfer.planner import arrange_destination, plan_transfer
from kv_transfer.state import TransferState
from kv_transfer.transport import TransferError, Transport

DEFAULT_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class TransferRecord:
    request_id: str
    state: TransferState
    bytes: int
    seconds: float
    sources: int
    cause: str | None = None  # why it failed

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class TransferStats:
    """Totals and the most recent transfers, for the node's metrics endpoint."""

    def __init__(self, keep: int = 256) -> None:
        self._lock = threading.Lock()  # pulls of several requests record from their own threads
        self.recent: deque[TransferRecord] = deque(maxlen=keep)
        self.done = 0
        self.bytes = 0
        self.seconds = 0.0
        self.failures: Counter[str] = Counter()

    def add(self, r: TransferRecord) -> None:
        with self._lock:
            self.recent.append(r)
            if r.state == TransferState.DONE:
                self.done += 1
                self.bytes += r.bytes
                self.seconds += r.seconds
            else:
                self.failures[r.cause or "unknown"] += 1

    def last(self, request_id: str) -> TransferRecord | None:
        """The latest record of a request, if it is still among the recent ones."""
        with self._lock:
            return next((r for r in reversed(self.recent) if r.request_id == request_id), None)


class Receiver:
    def __init__(
        self, transport: Transport, dest: CacheLayout, timeout_s: float = DEFAULT_TIMEOUT_S,
        stats: TransferStats | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.transport = transport
        self.dest = dest
        self.timeout_s = timeout_s
        self.stats = stats or TransferStats()

    def fill(
        self, request_id: str, request: RequestKV, sources: dict[int, CacheLayout], timeout_s: float | None = None
    ) -> Callable[[list[int]], list[int]]:
        """The ``add_prefilled`` callback for one request (``timeout_s``: this pull's limit, at most the
        receiver's)."""
        limit = self.timeout_s if timeout_s is None else min(timeout_s, self.timeout_s)

        def pull(block_ids: list[int]) -> list[int]:
            t0 = time.perf_counter()
            nbytes, nsrc = 0, 0
            try:
                table = arrange_destination(request, block_ids)
                plan = plan_transfer(request, sources, self.dest, table)
                nbytes, nsrc = plan.total_bytes, len(plan.by_source())
                batches = {sources[src].endpoint: segs for src, segs in plan.pull_segments().items()}
                self.transport.read_all(batches, limit)
            except TransferError as e:
                self.stats.add(TransferRecord(request_id, TransferState.FAILED, nbytes,
                                              time.perf_counter() - t0, nsrc, e.cause))
                raise
            except BaseException:
                self.stats.add(TransferRecord(request_id, TransferState.FAILED, nbytes,
                                              time.perf_counter() - t0, nsrc, "invalid"))
                raise
            self.stats.add(TransferRecord(request_id, TransferState.DONE, nbytes, time.perf_counter() - t0, nsrc))
            return table

        return pull

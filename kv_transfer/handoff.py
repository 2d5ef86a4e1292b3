"""The KV hand-off contract: one request's KV goes from the side that computed it to the side that decodes.

Both engines' nodes follow it (native ``prefill_node``/``decode_node``, and ``vllm_backend``'s
connector); only how they find the blocks differs.

Sender (``KVSender``, the prefill side): a finished prefill's blocks are **held** under a lease and
freed exactly once, by whichever comes first:

- **confirm**: the receiver has read them (native: ``PrefillService.Release``; vLLM: every consumer
  worker's notification);
- **abort**: the request was cancelled;
- **expire**: the lease ran out (default 30 s), so a receiver that vanished strands nothing.

Receiver (``KVReceiver``, the decode side): it owns the destination blocks, so it **pulls**
(nothing pushes): it plans from the sender's holders, reads from every source within a limit, then
confirms with the sender before it uses the KV. The limit is the receiver's own timeout, and at
most ``LEASE_SHARE`` of the sender's lease counted from the request's arrival (``pull_limit``): the
sender frees unconfirmed blocks at its lease, even mid-read. A confirmation the sender answers
with "not found" means the lease ran out first and the blocks may have been reused while they were
read: the request fails with ``KVLost``.

A failed pull may still have bytes in flight (Mooncake cannot cancel a batch), so a receiver keeps
the destination blocks aside for one more timeout before reusing them (quarantine).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

from kv_transfer.layout import CacheLayout, RequestKV, restrict
from kv_transfer.planner import TransferPlan, arrange_destination, plan_transfer
from kv_transfer.transport import TransferError, Transport

log = logging.getLogger("pdcluster.transfer")

DEFAULT_LEASE_S = 30.0
DEFAULT_TIMEOUT_S = 30.0
LEASE_SHARE = 0.5  # a pull may take at most this share of the sender's lease
SLOW_PULL_S = 1.0  # pulls slower than this are logged as warnings


class KVLost(RuntimeError):
    """The sender no longer held the request's blocks when the receiver confirmed its pull."""


# ------------------------------------------------------------------------------------- sender


@dataclass
class Lease:
    request_id: str
    deadline: float


class KVSender:
    """Held KV under leases; ``free(request_id)`` gives the blocks back (the engine's ``release``).

    Thread-safe: a lease ends exactly once, by ``confirm``, ``take``, ``abort`` or ``expire``, whichever
    comes first. ``free`` runs under the lock, on the thread that ended the lease (the owner's engine
    thread, except through ``take``, which frees nothing). ``expire`` is called by the owner's loop;
    the clock is injectable for tests.
    """

    def __init__(
        self,
        free: Callable[[str], object],
        lease_s: float = DEFAULT_LEASE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self._free = free
        self.lease_s = lease_s
        self._clock = clock
        self._leases: dict[str, Lease] = {}
        self._lock = threading.Lock()
        self.expired_total = 0

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._leases

    def hold(self, request_id: str, lease_s: float | None = None) -> Lease:
        with self._lock:
            if request_id in self._leases:
                raise ValueError(f"request {request_id!r} already holds a lease")
            lease = Lease(request_id, self._clock() + (lease_s if lease_s is not None else self.lease_s))
            self._leases[request_id] = lease
            return lease

    def _end(self, request_id: str) -> bool:
        with self._lock:
            if self._leases.pop(request_id, None) is None:
                return False
            self._free(request_id)
            return True

    def take(self, request_id: str) -> bool:
        """The receiver has the KV: end the lease without freeing; the caller frees the blocks later
        (its engine between two steps). False if nothing was held (expired, aborted). From any thread:
        an answer need not wait for the engine, and no lease can run out on the blocks meanwhile."""
        with self._lock:
            return self._leases.pop(request_id, None) is not None

    def confirm(self, request_id: str) -> bool:
        """The receiver has the KV: free the blocks. False if nothing was held (expired, aborted)."""
        return self._end(request_id)

    def abort(self, request_id: str) -> bool:
        """The request was cancelled: free the blocks."""
        return self._end(request_id)

    def expire(self) -> list[str]:
        """Free every lease past its deadline; returns their request ids."""
        now = self._clock()
        with self._lock:
            gone = [rid for rid, lease in self._leases.items() if lease.deadline <= now]
            for rid in gone:
                del self._leases[rid]
                self._free(rid)
            self.expired_total += len(gone)
        return gone


# ----------------------------------------------------------------------------------- receiver


def pull_limit(timeout_s: float, lease_s: float, arrived: float, now: float | None = None) -> float:
    """How long a pull may take: the receiver's timeout, and at most ``LEASE_SHARE`` of the sender's
    lease from the request's arrival (``time.monotonic()``); ``lease_s`` 0 = unknown, no cap.
    Raises ``TransferError("timeout")`` when no time is left."""
    if lease_s <= 0:
        return timeout_s
    left = LEASE_SHARE * lease_s - ((time.monotonic() if now is None else now) - arrived)
    if left <= 0:
        raise TransferError("timeout", "the sender's lease ran out before the pull started")
    return min(timeout_s, left)


@dataclass(frozen=True)
class TransferRecord:
    request_id: str
    ok: bool
    bytes: int
    seconds: float
    sources: int
    cause: str | None = None  # why it failed

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


Totals = tuple[int, int, float, dict[str, int]]  # done, bytes, seconds, failures by cause


def add_totals(totals: list[Totals]) -> Totals:
    """Several receivers' totals as one (a node's replicas)."""
    fails: Counter[str] = Counter()
    for _, _, _, f in totals:
        fails.update(f)
    return (sum(t[0] for t in totals), sum(t[1] for t in totals), sum(t[2] for t in totals), dict(fails))


class TransferStats:
    """Totals and the most recent transfers, for the node's Stats."""

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
            if r.ok:
                self.done += 1
                self.bytes += r.bytes
                self.seconds += r.seconds
            else:
                self.failures[r.cause or "unknown"] += 1

    def totals(self) -> Totals:
        """Transfers done, their bytes and seconds, and failures by cause."""
        with self._lock:
            return self.done, self.bytes, self.seconds, dict(self.failures)

    def last(self, request_id: str) -> TransferRecord | None:
        """The latest record of a request, if it is still among the recent ones."""
        with self._lock:
            return next((r for r in reversed(self.recent) if r.request_id == request_id), None)


class KVReceiver:
    """Pulls requests' KV into ``dest`` (this side's registered cache) through ``transport``."""

    def __init__(
        self, transport: Transport, dest: CacheLayout, timeout_s: float = DEFAULT_TIMEOUT_S,
        stats: TransferStats | None = None, optional: frozenset[int] = frozenset(),
    ) -> None:
        """``optional``: layers only one side may have (``plan_transfer``: the MTP layer's cache)."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.transport = transport
        self.dest = dest
        self.optional = optional
        self.timeout_s = timeout_s
        self.stats = stats or TransferStats()

    def limit(self, lease_s: float, arrived: float) -> float:
        """This pull's time limit (``pull_limit`` with the receiver's timeout)."""
        return pull_limit(self.timeout_s, lease_s, arrived)

    def pull(self, request_id: str, plan: TransferPlan, sources: dict[int, CacheLayout], limit_s: float) -> None:
        """Read every source's segments of ``plan`` within ``limit_s``; records the transfer; raises
        ``TransferError`` (with its cause) on failure."""
        t0 = time.perf_counter()
        nbytes, nsrc = plan.total_bytes, len(plan.by_source())
        try:
            batches = {sources[src].endpoint: segs for src, segs in plan.pull_segments().items()}
            self.transport.read_all(batches, min(limit_s, self.timeout_s))
        except BaseException as e:
            cause = e.cause if isinstance(e, TransferError) else "invalid"
            self.stats.add(TransferRecord(request_id, False, nbytes, time.perf_counter() - t0, nsrc, cause))
            raise
        took = time.perf_counter() - t0
        self.stats.add(TransferRecord(request_id, True, nbytes, took, nsrc))
        (log.warning if took > SLOW_PULL_S else log.debug)(
            "pulled %s: %d bytes from %d sources in %d segments in %.3fs (%.1f GB/s)", request_id, nbytes, nsrc,
            len(plan.copies), took, nbytes / max(took, 1e-9) / 1e9)

    def pull_into(
        self, request_id: str, request: RequestKV, sources: dict[int, CacheLayout], block_ids: list[int],
        limit_s: float | None = None,
    ) -> list[int]:
        """Pull one request's KV into ``block_ids`` (allocated for it: ``LLMEngine.begin_prefilled``) and
        return its block table: the blocks are arranged so that copies coalesce, planned and pulled
        within ``limit_s`` (default: the receiver's timeout; ``pull`` caps it there).

        Fewer blocks than the request has are for its trailing blocks: this side holds the leading
        ones already (its prefix cache hit), so only the rest is pulled, and the table is theirs."""
        wanted = request
        have = request.num_blocks - len(block_ids)
        if have > 0:
            wanted = restrict(request.holders, list(range(have, request.num_blocks)))
        if not wanted.num_blocks:
            return []  # every block was here already
        try:
            table = arrange_destination(wanted, block_ids)
            plan = plan_transfer(wanted, sources, self.dest, table, self.optional)
        except BaseException:
            self.stats.add(TransferRecord(request_id, False, 0, 0.0, 0, "invalid"))
            raise
        self.pull(request_id, plan, sources, self.timeout_s if limit_s is None else limit_s)
        return table

"""Automatic prefix caching: KV blocks of full token blocks are kept after use and shared by prompts
that start the same way (vLLM's scheme).

A full block's hash chains from the prompt's start: ``block_hash(parent, tokens)`` over the hash of
the block before it and the block's own token ids, so equal hashes mean equal prefixes up to and
including that block. ``PrefixCache`` wraps a block allocator (one rank's, or a sharded or
replicated set of ranks': block ids are the allocator's global ids, and a block cached for logical
position j is only ever reused at position j, where the sharded layout places the same owner):

- every block in use has a reference count; a request that hits the cache takes references on the
  cached blocks of its prefix and computes only the rest;
- a block whose count drops to 0 stays cached, if it was registered with a hash, in LRU order
  (it counts as free); allocation evicts the least recently used of those only when the allocator
  has no free block left;
- blocks are registered once their tokens are all computed (``register``), by the engine after a
  step; a block that is still being written is never shared;
- what joined and left the cache since the last ``take_events`` is kept (net, per hash; at most
  ``MAX_PENDING_EVENTS``, the oldest dropped), for a node to publish as KV events.

The hashes (``engine.block_hash``) are stable across processes, so the proxy computes the same
ones to guess where a prompt's prefix is cached (``proxy.routing.prefix_index``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from engine.kv_cache import BlockSpace

MAX_PENDING_EVENTS = 1 << 16  # hashes stored or evicted and not yet taken: the oldest beyond are dropped


def split_events(events: dict[int, bool]) -> tuple[list[int], list[int]]:
    """Pending events (hash -> stored, or evicted) as (stored, evicted) hashes. Copies the items in one
    C call first: another thread may still write to a dict it took before it was swapped out."""
    items = list(events.items())
    return [h for h, on in items if on], [h for h, on in items if not on]


class PrefixCache:
    """A ``BlockSpace`` with reference counts and cached blocks kept after use (see the module doc)."""

    def __init__(self, inner: BlockSpace) -> None:
        self.inner = inner
        self._refs: dict[int, int] = {}  # block -> requests using it (> 0)
        self._hash_of: dict[int, int] = {}  # registered block -> its hash
        self._block_of: dict[int, int] = {}  # hash -> registered block
        self._idle: OrderedDict[int, None] = OrderedDict()  # registered, unused blocks, least recent first
        self.hits = 0  # blocks found in the cache, since start
        self.queries = 0  # blocks looked up
        self._events: dict[int, bool] = {}  # hash -> stored (True) or evicted (False) since take_events
        self._events_lock = threading.Lock()  # the engine thread records, a heartbeat thread takes

    # -- BlockSpace ----------------------------------------------------------------------------
    @property
    def num_used(self) -> int:
        return self.inner.num_used - len(self._idle)

    @property
    def num_free(self) -> int:
        return self.inner.num_free + len(self._idle)

    @property
    def num_cached(self) -> int:
        """Registered blocks no request uses: kept for a later hit, evicted when blocks run out."""
        return len(self._idle)

    def can_allocate(self, n: int, first: int = 0) -> bool:
        """Whether ``n`` blocks can be had now; evicts cached blocks (least recent first) until they
        can, so a True answer leaves the room ``allocate`` takes."""
        while not self.inner.can_allocate(n, first) and self._idle:
            self._evict_one()
        return self.inner.can_allocate(n, first)

    def allocate(self, n: int, first: int = 0) -> list[int]:
        if not self.can_allocate(n, first):
            raise MemoryError(f"asked for {n} KV blocks, {self.num_free} free or cached")
        ids = self.inner.allocate(n, first)
        for b in ids:
            self._refs[b] = 1
        return ids

    def free(self, ids: list[int]) -> None:
        """Drop one reference per block; unused registered blocks stay cached, others go back."""
        back = []
        for b in ids:
            refs = self._refs.get(b, 0)
            if refs <= 0:
                raise ValueError(f"block {b} freed twice or never allocated")
            if refs > 1:
                self._refs[b] = refs - 1
                continue
            del self._refs[b]
            if b in self._hash_of:
                self._idle[b] = None
            else:
                back.append(b)
        if back:
            self.inner.free(back)

    def used_per_rank(self) -> list[int]:
        """Used blocks per PCP rank of a sharded allocator (cached ones are not in use)."""
        per_rank = getattr(self.inner, "used_per_rank", None)
        if per_rank is None:
            return [self.num_used]
        used = list(per_rank())
        pcp = len(used)
        for b in self._idle:
            used[b % pcp] -= 1  # a sharded global id is physical · pcp + owner
        return used

    # -- the cache -----------------------------------------------------------------------------
    def match(self, hashes: Sequence[int], spare: int = 0) -> list[int]:
        """Take a reference on the cached blocks of the longest prefix of ``hashes``, but its last ``spare``
        ones; their ids."""
        ids: list[int] = []
        for h in hashes:
            b = self._block_of.get(h)
            if b is None:
                break
            ids.append(b)
        ids = ids[: max(0, len(ids) - spare)]
        self.queries += len(hashes)
        self.hits += len(ids)
        for b in ids:
            if b in self._idle:
                del self._idle[b]
                self._refs[b] = 1
            else:
                self._refs[b] += 1
        return ids

    def register(self, block: int, h: int) -> None:
        """``block`` holds the computed tokens of the block hashed ``h``: later prompts may share it.
        If another block already holds them (computed at the same time), this one is not cached."""
        if block in self._hash_of or h in self._block_of:
            return
        if self._refs.get(block, 0) <= 0:
            raise ValueError(f"block {block} is not in use")
        self._hash_of[block] = h
        self._block_of[h] = block
        self._event(h, True)

    def reset(self) -> None:
        """Forget every cached block no request uses (they go back to the allocator)."""
        while self._idle:
            self._evict_one()

    def take_events(self) -> tuple[list[int], list[int]]:
        """The hashes stored in and evicted from the cache since the last call (net of each other)."""
        with self._events_lock:
            events, self._events = self._events, {}
        return split_events(events)

    def _event(self, h: int, stored: bool) -> None:
        with self._events_lock:
            self._events[h] = stored
            if len(self._events) > MAX_PENDING_EVENTS:
                del self._events[next(iter(self._events))]

    def _evict_one(self) -> None:
        b, _ = self._idle.popitem(last=False)
        h = self._hash_of.pop(b)
        del self._block_of[h]
        self._event(h, False)
        self.inner.free([b])

"""Where a prompt's prefix is probably cached: per replica, the block hashes it probably holds.

A node with prefix caching keeps the KV of full blocks after use until it needs the room. Per
prefill replica or decode rank the index keeps block hashes (``engine.block_hash``, the engine's
own), in LRU order, at most as many as the replica has KV blocks, from two sources:

- the proxy's own record of what it sent where (``record``): a prefill replica caches the prompts it
  prefilled, a decode rank the prompts it pulled and the answers it computed. Immediate, but blind
  to other proxies (and other workers of this one) and to evictions;
- the nodes' KV events (``apply``; published with their heartbeats on the registry's pub/sub,
  ``proxy.routing.kv_events`` follows them): what each replica's cache stored and evicted, a heartbeat late.
  A node that restarted (another ``started_at``) starts empty.

A prompt's expected hit on a replica is the number of its leading full blocks found there. The
index is approximate and that is harmless: a miss costs a full prefill (or pull), as without
caching. The router lowers a prefill replica's estimated cost by the expected hit and prefers the
decode rank expected to hold the most of the prompt.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from cluster.nodes import KVEvents
from engine.block_hash import prompt_block_hashes


class PrefixIndex:
    """Block hashes per (node id, DP rank), each an LRU bounded by the replica's KV blocks."""

    def __init__(self) -> None:
        self._replicas: dict[tuple[str, int], OrderedDict[int, None]] = {}
        self._started: dict[str, float] = {}  # node id -> its started_at, as its KV events last said

    @staticmethod
    def hashes(prompt: Sequence[int], block_size: int) -> list[int]:
        """The prompt's full-block hashes that can hit (the last token is always computed)."""
        return prompt_block_hashes(prompt, block_size, limit=(len(prompt) - 1) // block_size)

    def expected_hit(self, node_id: str, dp_rank: int, hashes: Sequence[int]) -> int:
        """Leading blocks of ``hashes`` recorded for the replica."""
        seen = self._replicas.get((node_id, dp_rank))
        if not seen:
            return 0
        n = 0
        for h in hashes:
            if h not in seen:
                break
            n += 1
        return n

    def record(self, node_id: str, dp_rank: int, hashes: Sequence[int], capacity: int) -> None:
        """The replica prefilled a prompt with these block hashes; it keeps at most ``capacity`` blocks."""
        seen = self._replicas.setdefault((node_id, dp_rank), OrderedDict())
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > max(0, capacity):
            seen.popitem(last=False)

    def apply(self, events: KVEvents, capacity: int) -> None:
        """A replica's KV events: its cache stored and evicted these block hashes."""
        if self._started.get(events.node_id, events.started_at) != events.started_at:  # restarted: empty
            for key in [k for k in self._replicas if k[0] == events.node_id]:
                del self._replicas[key]
        self._started[events.node_id] = events.started_at
        if events.stored:
            self.record(events.node_id, events.dp_rank, events.stored, capacity)
        seen = self._replicas.get((events.node_id, events.dp_rank))
        if seen is not None:
            for h in events.removed:
                seen.pop(h, None)

    def forget(self, keep: set[str]) -> None:
        """Drop the records of nodes no longer known."""
        for key in [k for k in self._replicas if k[0] not in keep]:
            del self._replicas[key]
        for node_id in [n for n in self._started if n not in keep]:
            del self._started[node_id]

"""Where a prompt's prefix is probably cached: the proxy's own record of what it sent where.

A prefill node with prefix caching keeps the KV of the full blocks of the prompts it prefilled until
it needs the room. The proxy sent those prompts, so it knows them: per prefill replica it keeps the
block hashes (``engine.block_hash``, the engine's own) of the prompts it routed there, in LRU order,
at most as many as the replica has KV blocks. A prompt's expected hit on a replica is the number of
its leading full blocks found there. The record is approximate (the node may have evicted a block
sooner, another proxy may have filled the cache) and that is harmless: a miss costs a full prefill,
as without caching. The router lowers a replica's estimated cost by the expected hit.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from engine.block_hash import prompt_block_hashes


class PrefixIndex:
    """Block hashes per (node id, DP rank), each an LRU bounded by the replica's KV blocks."""

    def __init__(self) -> None:
        self._replicas: dict[tuple[str, int], OrderedDict[int, None]] = {}

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

    def forget(self, keep: set[str]) -> None:
        """Drop the records of nodes no longer known."""
        for key in [k for k in self._replicas if k[0] not in keep]:
            del self._replicas[key]

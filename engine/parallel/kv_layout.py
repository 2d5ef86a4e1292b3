"""Where a request's KV blocks live across the PCP ranks of a replica, and who allocates them.

The driver keeps one block table per request in *global* block ids:

- ``replicated``: every PCP rank holds every block; a global id is the physical block id on each rank.
- ``sharded``: logical block ``j`` of a request (tokens ``[j·bs, (j+1)·bs)``) lives on exactly one PCP
  rank, ``kv_owner(j·bs)`` (runs of ``interleave`` tokens rotate over the ranks). Its global id is
  ``physical · PCP + owner``, so the owner and the physical id can be recovered from the id alone.

Every PP stage of a PCP rank uses the same physical ids for its own layers (the last stage's include the
multi-token prediction layer's cache under speculative decoding, sharded as the others), so one allocator per
PCP rank serves all stages. The ownership query (``kv_ownership``) answers, for a request, which
(pcp, pp) rank holds which physical blocks for which layers: what kv_transfer consumes.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv_cache import BlockAllocator
from engine.parallel.grid import ParallelConfig, stage_layers
from engine.parallel.pcp_split import kv_owner


class ShardedBlockAllocator:
    """Allocates each logical block on its owning PCP rank; ids are ``physical · pcp + owner``."""

    def __init__(self, num_blocks_per_rank: int, pcp: int, block_size: int, interleave: int) -> None:
        if interleave % block_size:
            raise ValueError(f"interleave {interleave} must be a multiple of block_size {block_size}")
        self.pcp = pcp
        self.block_size = block_size
        self.interleave = interleave
        self.ranks = [BlockAllocator(num_blocks_per_rank) for _ in range(pcp)]
        self.num_blocks = num_blocks_per_rank * pcp

    def _owners(self, n: int, first: int) -> list[int]:
        return [kv_owner(j * self.block_size, self.pcp, self.interleave) for j in range(first, first + n)]

    def _counts(self, owners: list[int]) -> list[int]:
        counts = [0] * self.pcp
        for r in owners:
            counts[r] += 1
        return counts

    @property
    def num_free(self) -> int:
        return sum(a.num_free for a in self.ranks)

    @property
    def num_used(self) -> int:
        return sum(a.num_used for a in self.ranks)

    def used_per_rank(self) -> list[int]:
        return [a.num_used for a in self.ranks]

    def can_allocate(self, n: int, first: int = 0) -> bool:
        counts = self._counts(self._owners(n, first))
        return all(c <= a.num_free for c, a in zip(counts, self.ranks))

    def allocate(self, n: int, first: int = 0) -> list[int]:
        """Global ids of logical blocks ``[first, first + n)`` of one request."""
        owners = self._owners(n, first)
        counts = self._counts(owners)
        if any(c > a.num_free for c, a in zip(counts, self.ranks)):
            raise MemoryError(f"asked for {n} KV blocks from logical block {first}; free per rank: "
                              f"{[a.num_free for a in self.ranks]}")
        fresh = [iter(a.allocate(c)) for a, c in zip(self.ranks, counts)]
        return [next(fresh[r]) * self.pcp + r for r in owners]

    def free(self, ids: list[int]) -> None:
        for gid in ids:
            self.ranks[gid % self.pcp].free([gid // self.pcp])


def max_blocks_per_rank(num_tokens: int, block_size: int, pcp: int, interleave: int) -> int:
    """Blocks the busiest PCP rank holds for one request of ``num_tokens`` (sharded layout)."""
    counts = [0] * pcp
    for j in range(-(-num_tokens // block_size)):
        counts[kv_owner(j * block_size, pcp, interleave)] += 1
    return max(counts)


def local_block_ids(global_ids: list[int], par: ParallelConfig, pcp_rank: int) -> list[int]:
    """Per logical block, this PCP rank's physical id, or -1 where another rank holds it."""
    if par.kv_layout == "replicated" or par.pcp == 1:
        return list(global_ids)
    return [g // par.pcp if g % par.pcp == pcp_rank else -1 for g in global_ids]


@dataclass(frozen=True)
class RankBlocks:
    """The blocks of one request held by one (pcp, pp) rank of a DP replica."""

    dp: int
    pcp: int
    pp: int
    rank: int  # global rank in the node's world
    layers: range  # the global layer indices this rank's cache holds
    logical: list[int]  # logical block index j (tokens [j·bs, (j+1)·bs)) ...
    physical: list[int]  # ... and its physical block id in this rank's cache


def kv_ownership(global_ids: list[int], par: ParallelConfig, dp: int, num_layers: int,
                 mtp_layers: int = 0) -> list[RankBlocks]:
    """For a request with block table ``global_ids``, which rank holds which blocks for which layers.
    ``mtp_layers``: cache layers after the stack's ``num_layers`` (the multi-token prediction layer's, under
    speculative decoding), held by the last stage beside its own."""
    out = []
    for pp in range(par.pp):
        layers = stage_layers(num_layers, par.pp, pp)
        if pp == par.pp - 1:
            layers = range(layers.start, layers.stop + mtp_layers)
        for pcp in range(par.pcp):
            local = local_block_ids(global_ids, par, pcp)
            held = [(j, b) for j, b in enumerate(local) if b >= 0]
            out.append(RankBlocks(dp, pcp, pp, par.rank(dp, pp, pcp), layers,
                                  [j for j, _ in held], [b for _, b in held]))
    return out

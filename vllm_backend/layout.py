"""Where vLLM keeps a request's MLA KV across the ranks of one engine, as our planner's holders.

vLLM (0.32) rules this module follows, for one DP replica of ``PP × PCP × TP`` workers:

- worker rank ``((pp · PCP) + pcp) · TP + tp`` (the same order as ``engine.parallel.grid``);
- MLA's latent cache is not split by TP: every TP rank holds the same bytes;
- DCP shards the cache. Its group is taken from the ranks ordered ``(tp, pcp)`` with PCP
  innermost, cut into groups of ``DCP``: ``dcp_rank = (tp · PCP + pcp) % DCP`` (DCP must divide TP
  without PCP; with PCP it is 1, PCP or TP · PCP);
- with DCP = 1 every PCP rank (and every TP rank) holds a full replica;
- with DCP > 1 the scheduler's block holds ``block_size · DCP`` tokens (a *virtual* block) and has
  the same id on every rank; position ``i`` lives on the rank with
  ``(i // interleave) % DCP == dcp_rank`` (``interleave`` = ``cp_kv_cache_interleave_size``, which
  divides ``block_size``), at slot ``block_id · block_size + (o // (DCP · interleave)) · interleave
  + o % interleave`` where ``o = i % (block_size · DCP)``.

The planner moves *units*: runs of ``unit`` consecutive positions that are contiguous in both
caches. ``unit`` divides both sides' block sizes and, where a side shards (DCP > 1), its
interleave. A rank's cache seen in units is a ``CacheLayout`` whose "blocks" are units
(``unit_layout``), and a request's holders are ``RankBlocks`` whose logical/physical ids are unit
indices (``holders``), so ``plan_transfer`` and its coalescing serve any pair of layouts unchanged.
With ``interleave == block_size`` (or DCP = 1 on both sides) a unit is a whole block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.parallel.kv_layout import RankBlocks
from kv_transfer.layout import CacheLayout, LayerRegion


@dataclass(frozen=True)
class VllmKVLayout:
    """The KV layout of one vLLM engine replica (its ``ParallelConfig`` and cache block size)."""

    tp: int = 1
    pcp: int = 1
    dcp: int = 1
    pp: int = 1
    interleave: int = 1  # cp_kv_cache_interleave_size
    block_size: int = 16  # tokens per physical block on one rank

    def __post_init__(self) -> None:
        for name in ("tp", "pcp", "dcp", "pp", "interleave", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.pcp == 1 and self.tp % self.dcp:
            raise ValueError(f"tp {self.tp} must be divisible by dcp {self.dcp}")
        if self.pcp > 1 and self.dcp not in (1, self.pcp, self.tp * self.pcp):
            raise ValueError(f"with pcp {self.pcp}, dcp must be 1, pcp or tp·pcp, got {self.dcp}")
        if self.block_size % self.interleave:
            raise ValueError(f"block_size {self.block_size} must be divisible by interleave {self.interleave}")

    @property
    def world_size(self) -> int:
        return self.pp * self.pcp * self.tp

    @property
    def virtual_block_size(self) -> int:
        """Tokens per scheduler block (the id every rank shares)."""
        return self.block_size * self.dcp

    def rank(self, pp: int, pcp: int, tp: int) -> int:
        return (pp * self.pcp + pcp) * self.tp + tp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(pp, pcp, tp)`` of a worker rank."""
        return rank // (self.pcp * self.tp), rank // self.tp % self.pcp, rank % self.tp

    def dcp_rank(self, pcp: int, tp: int) -> int:
        return (tp * self.pcp + pcp) % self.dcp

    def owner(self, pos: int) -> int:
        """The DCP rank holding position ``pos``."""
        return (pos % self.virtual_block_size) // self.interleave % self.dcp

    def slot(self, pos: int, block_ids: list[int]) -> int:
        """Slot (``block · block_size + offset``) of position ``pos`` on its owner."""
        vb, o = divmod(pos, self.virtual_block_size)
        offset = o // (self.dcp * self.interleave) * self.interleave + o % self.interleave
        return block_ids[vb] * self.block_size + offset


def transfer_unit(src: VllmKVLayout, dst: VllmKVLayout) -> int:
    """Positions per copied unit: contiguous on both sides whatever their sharding."""
    parts = [src.block_size, dst.block_size]
    parts += [x.interleave for x in (src, dst) if x.dcp > 1]
    return math.gcd(*parts)


def unit_layout(layout: CacheLayout, block_size: int, unit: int) -> CacheLayout:
    """A rank's cache layout with ``unit``-position "blocks" (``block_size`` must be a multiple)."""
    if block_size % unit:
        raise ValueError(f"block_size {block_size} is not a multiple of the unit {unit}")
    k = block_size // unit
    regions = {i: LayerRegion(i, r.base, r.num_blocks * k, r.block_bytes // k) for i, r in layout.regions.items()}
    return CacheLayout(layout.endpoint, regions)


def units_of(layout: VllmKVLayout, pcp: int, tp: int, block_ids: list[int], start: int, end: int,
             unit: int) -> list[tuple[int, int]]:
    """``(unit index, physical unit id)`` of the units of positions ``[start, end)`` this rank holds.

    ``start`` is a multiple of ``unit``; the last unit may run past ``end`` (its tail is slots the
    request owns but has not written: copying them is harmless).
    """
    if start % unit:
        raise ValueError(f"start {start} is not a multiple of the unit {unit}")
    me = layout.dcp_rank(pcp, tp)
    out = []
    for j in range(start // unit, -(-end // unit)):
        pos = j * unit
        if layout.owner(pos) == me:
            out.append((j, layout.slot(pos, block_ids) // unit))
    return out


def holders(layout: VllmKVLayout, block_ids: list[int], start: int, end: int, unit: int,
            layers: dict[int, range], dp: int = 0) -> list[RankBlocks]:
    """Every worker's units of positions ``[start, end)``, as the planner's holders.

    ``block_ids`` is the request's scheduler block table; ``layers`` maps each worker rank to the
    global layers its cache holds (its PP stage). TP ranks (and, with DCP = 1, PCP ranks) come out
    as replicas holding the same units.
    """
    out = []
    for rank in range(layout.world_size):
        pp, pcp, tp = layout.coords(rank)
        held = units_of(layout, pcp, tp, block_ids, start, end, unit)
        out.append(RankBlocks(dp, pcp, pp, rank, layers[rank], [j for j, _ in held], [u for _, u in held]))
    return out


def native_units(hs: list[RankBlocks], block_size: int, unit: int, start: int, end: int,
                 layers: set[int]) -> list[RankBlocks]:
    """A native engine's holders (whole blocks of ``block_size``) as unit holders of ``[start, end)``.

    Logical block ``j`` with physical id ``p`` is units ``j·k .. j·k+k-1`` at unit ids
    ``p·k ..`` (``k = block_size // unit``); each holder keeps only the ``layers`` wanted here.
    """
    if block_size % unit:
        raise ValueError(f"block_size {block_size} is not a multiple of the unit {unit}")
    k, first, last = block_size // unit, start // unit, -(-end // unit)
    out = []
    for h in hs:
        mine = sorted(layers & set(h.layers))
        pairs = [(j * k + i, p * k + i) for j, p in zip(h.logical, h.physical) for i in range(k)
                 if first <= j * k + i < last]
        if mine and pairs:
            out.append(RankBlocks(h.dp, h.pcp, h.pp, h.rank, range(mine[0], mine[-1] + 1),
                                  [a for a, _ in pairs], [b for _, b in pairs]))
    return out


def spread_replicas(hs: list[RankBlocks]) -> list[RankBlocks]:
    """Give each group of replicas (same stage, same units) contiguous, even shares of its units.

    ``plan_transfer`` spreads replicated blocks itself, but per stretch of blocks with the same
    holders; with DCP > 1 those stretches alternate between shards and are one unit long, so every
    unit would come from the first replica. Splitting each shard's units among its replicas first
    gives every source about the same bytes in both cases (DCP = 1: the same split as the planner's).
    """
    groups: dict[tuple[int, tuple[int, ...]], list[RankBlocks]] = {}
    for h in hs:
        groups.setdefault((h.pp, tuple(h.logical)), []).append(h)
    out = []
    for (_, logical), members in groups.items():
        n, k = len(logical), len(members)
        start = 0
        for i, h in enumerate(sorted(members, key=lambda h: h.rank)):
            size = n // k + (1 if i < n % k else 0)
            out.append(RankBlocks(h.dp, h.pcp, h.pp, h.rank, h.layers, h.logical[start:start + size],
                                  h.physical[start:start + size]))
            start += size
    return sorted(out, key=lambda h: h.rank)

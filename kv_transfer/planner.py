"""Transfer planning: for every destination block, a source among its holders, as coalesced copies.

- Each PP stage is planned on its own: its ranks hold only its layers.
- A block held by one rank (sharded layout) comes from that rank, so a request fans in from every
  shard. A block held by several (replicated layout) comes from one of them: the stage's blocks are
  cut into contiguous parts of sizes differing by at most one block, part i from the i-th replica
  (deterministic, and the bytes per source differ by at most one block).
- Consecutive logical blocks whose source and destination physical ids are both consecutive form
  one copy per layer (a contiguous byte range on both sides), which is what batch transfer
  descriptors want.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from engine.parallel.kv_layout import RankBlocks
from kv_transfer.layout import CacheLayout, LayerRegion, RequestKV
from kv_transfer.transport import Segment


@dataclass(frozen=True)
class Copy:
    """One contiguous byte range of one layer, from a source rank to the destination."""

    source: int  # global rank of the source
    layer: int
    src_addr: int
    dst_addr: int
    nbytes: int
    first_block: int  # logical block of the run's start
    num_blocks: int


@dataclass
class TransferPlan:
    copies: list[Copy] = field(default_factory=list)

    def by_source(self) -> dict[int, list[Copy]]:
        out: dict[int, list[Copy]] = defaultdict(list)
        for c in self.copies:
            out[c.source].append(c)
        return dict(out)

    def bytes_by_source(self) -> dict[int, int]:
        return {src: sum(c.nbytes for c in cs) for src, cs in self.by_source().items()}

    @property
    def total_bytes(self) -> int:
        return sum(c.nbytes for c in self.copies)

    def pull_segments(self) -> dict[int, list[Segment]]:
        """Per source rank, the segments the destination reads (local = destination range)."""
        return {src: [Segment(c.dst_addr, c.src_addr, c.nbytes) for c in cs] for src, cs in self.by_source().items()}


def _assign(stage: list[RankBlocks], num_blocks: int) -> dict[int, RankBlocks]:
    """Logical block -> the holder it is read from (see the module docstring)."""
    holders_of: dict[int, list[RankBlocks]] = defaultdict(list)
    for h in sorted(stage, key=lambda h: h.pcp):
        for j in h.logical:
            if j < num_blocks:
                holders_of[j].append(h)
    out: dict[int, RankBlocks] = {}
    j = 0
    while j < num_blocks:
        # A stretch of blocks with the same holders is split evenly and contiguously among them.
        ranks = [h.rank for h in holders_of[j]]
        end = j
        while end < num_blocks and [h.rank for h in holders_of[end]] == ranks:
            end += 1
        n, k = end - j, len(ranks)
        start = j
        for i, h in enumerate(holders_of[j]):
            size = n // k + (1 if i < n % k else 0)
            for b in range(start, start + size):
                out[b] = h
            start += size
        j = end
    return out


def plan_transfer(
    request: RequestKV,
    sources: dict[int, CacheLayout],
    dest: CacheLayout,
    dest_blocks: list[int],
) -> TransferPlan:
    """Copies that fill ``dest_blocks[j]`` (every layer of ``dest``) with logical block j of the request.

    ``sources`` maps a holder's global rank to its registered cache layout.
    """
    if len(dest_blocks) < request.num_blocks:
        raise ValueError(f"{request.num_blocks} blocks to move but {len(dest_blocks)} destination blocks")
    plan = TransferPlan()
    stages: dict[int, list[RankBlocks]] = defaultdict(list)
    for h in request.holders:
        stages[h.pp].append(h)
    covered: set[int] = set()
    for pp in sorted(stages):
        stage = stages[pp]
        layers = list(stage[0].layers)
        covered.update(layers)
        owner = _assign(stage, request.num_blocks)
        phys = {h.rank: dict(zip(h.logical, h.physical)) for h in stage}
        for layer in layers:
            dst = dest.region(layer)
            run: list[int] = []  # logical blocks of the current run
            for j in range(request.num_blocks + 1):
                if run and (j == request.num_blocks or not _extends(run, j, owner, phys, dest_blocks)):
                    plan.copies.append(_copy(run, owner[run[0]].rank, layer, sources, dst, phys, dest_blocks))
                    run = []
                if j < request.num_blocks:
                    run.append(j)
    missing = sorted(set(dest.layers) - covered)
    if missing:
        raise ValueError(f"no PP stage holds layers {missing} that the destination expects")
    return plan


def _extends(
    run: list[int], j: int, owner: dict[int, RankBlocks], phys: dict[int, dict[int, int]], dest_blocks: list[int]
) -> bool:
    last = run[-1]
    src = owner[last].rank
    return (
        owner[j].rank == src
        and phys[src][j] == phys[src][last] + 1
        and dest_blocks[j] == dest_blocks[last] + 1
    )


def _copy(
    run: list[int],
    src: int,
    layer: int,
    sources: dict[int, CacheLayout],
    dst_region: LayerRegion,
    phys: dict[int, dict[int, int]],
    dest_blocks: list[int],
) -> Copy:
    if src not in sources:
        raise ValueError(f"no cache layout for source rank {src}")
    src_region = sources[src].region(layer)
    if src_region.block_bytes != dst_region.block_bytes:
        raise ValueError(
            f"layer {layer}: source blocks of {src_region.block_bytes} bytes, destination blocks of "
            f"{dst_region.block_bytes} bytes: block sizes must match"
        )
    first, last = run[0], run[-1]
    src_region.block_addr(phys[src][last])  # range checks of the run's end on both sides
    dst_region.block_addr(dest_blocks[last])
    return Copy(
        source=src,
        layer=layer,
        src_addr=src_region.block_addr(phys[src][first]),
        dst_addr=dst_region.block_addr(dest_blocks[first]),
        nbytes=len(run) * src_region.block_bytes,
        first_block=first,
        num_blocks=len(run),
    )

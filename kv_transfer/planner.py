"""Transfer planning: for every destination block, a source among its holders, as coalesced copies.

- Each PP stage is planned on its own: its ranks hold only its layers.
- A block held by one rank (sharded layout) comes from that rank, so a request fans in from every
  shard. A block held by several (replicated layout) comes from one of them: the stage's blocks are
  cut into contiguous parts of sizes differing by at most one block, part i from the i-th replica
  (deterministic, and the bytes per source differ by at most one block).
- A source's blocks (in logical order) whose source and destination physical ids are both
  consecutive form one copy per layer (a contiguous byte range on both sides), which is what batch
  transfer descriptors want. ``arrange_destination`` picks destination ids so that they are.
- Layers only one side has: an ``optional`` layer (the multi-token prediction layer's cache, which only a
  node with speculative decoding has) moves when both sides have it; any other layer must be on both.
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
    blocks: tuple[int, ...]  # the logical blocks the range holds, in order


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


def arrange_destination(request: RequestKV, dest_ids: list[int]) -> list[int]:
    """Which destination block each logical block gets, chosen so copies coalesce.

    The decode side may place logical blocks anywhere. Giving each source's blocks consecutive
    destination ids (in the source's order) makes every source one run per layer when ``dest_ids``
    are contiguous, instead of one copy per block when sharded blocks alternate between ranks.
    Returns ``dest_blocks`` with ``dest_blocks[j]`` for logical block j.
    """
    if len(dest_ids) < request.num_blocks:
        raise ValueError(f"{request.num_blocks} blocks to move but {len(dest_ids)} destination blocks")
    first_stage = min(h.pp for h in request.holders)
    owner = _assign([h for h in request.holders if h.pp == first_stage], request.num_blocks)
    order = sorted(range(request.num_blocks), key=lambda j: (owner[j].pcp, j))
    out = [0] * request.num_blocks
    for j, d in zip(order, sorted(dest_ids)[: request.num_blocks]):
        out[j] = d
    return out


def plan_transfer(
    request: RequestKV,
    sources: dict[int, CacheLayout],
    dest: CacheLayout,
    dest_blocks: list[int],
    optional: frozenset[int] = frozenset(),
) -> TransferPlan:
    """Copies that fill ``dest_blocks[j]`` (every layer of ``dest``; of the ``optional`` layers, those the
    request's holders have too) with logical block j of the request.

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
        wanted = set(dest.layers)
        layers = [layer for layer in stage[0].layers if layer in wanted or layer not in optional]
        covered.update(layers)
        owner = _assign(stage, request.num_blocks)
        phys = {h.rank: dict(zip(h.logical, h.physical)) for h in stage}
        per_source: dict[int, list[int]] = defaultdict(list)  # source rank -> its logical blocks, in order
        for j in range(request.num_blocks):
            per_source[owner[j].rank].append(j)
        for layer in layers:
            dst = dest.region(layer)
            for src, blocks in per_source.items():
                run: list[int] = []  # the source's blocks with consecutive ids on both sides
                for j in blocks:
                    if run and not (phys[src][j] == phys[src][run[-1]] + 1
                                    and dest_blocks[j] == dest_blocks[run[-1]] + 1):
                        plan.copies.append(_copy(run, src, layer, sources, dst, phys, dest_blocks))
                        run = []
                    run.append(j)
                plan.copies.append(_copy(run, src, layer, sources, dst, phys, dest_blocks))
    missing = sorted(set(dest.layers) - covered - optional)
    if missing:
        raise ValueError(f"no PP stage holds layers {missing} that the destination expects")
    return plan


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
        blocks=tuple(run),
    )

"""The KV handle on the wire: a prefill request's holders and its sources' cache layouts.

The prefill node builds a ``pb.KVHandle`` from its ownership query and its ranks' registered
layouts; the proxy carries it to the decode node, which turns it back into the planner's types.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.proto_gen import pdcluster_v1_pb2 as pb
from engine.parallel.kv_layout import RankBlocks
from kv_transfer.layout import CacheLayout, LayerRegion, RequestKV


@dataclass(frozen=True)
class KVSource:
    """What the decode side needs to pull one request: holders, layouts, and whom to confirm with."""

    request: RequestKV
    layouts: dict[int, CacheLayout]  # global prefill rank -> its registered cache
    prefill_node_id: str
    prefill_address: str
    block_size: int
    lease_s: float = 0.0  # how long the prefill node keeps the blocks unconfirmed (0: unknown)


def to_handle(
    holders: list[RankBlocks],
    num_blocks: int,
    layouts: dict[int, CacheLayout],
    *,
    node_id: str,
    address: str,
    dp_rank: int,
    block_size: int,
    lease_s: float,
    kv_format: str,
) -> pb.KVHandle:
    ranks = sorted({h.rank for h in holders})
    return pb.KVHandle(
        prefill_node_id=node_id,
        prefill_address=address,
        dp_rank=dp_rank,
        num_blocks=num_blocks,
        block_size=block_size,
        transport="mooncake",
        lease_s=lease_s,
        kv_format=kv_format,
        sources=[
            pb.CacheLayout(
                rank=r,
                endpoint=layouts[r].endpoint,
                regions=[pb.LayerRegion(layer=g.layer, base=g.base, num_blocks=g.num_blocks, block_bytes=g.block_bytes)
                         for g in layouts[r].regions.values()],
            )
            for r in ranks
        ],
        holders=[
            pb.RankBlocks(rank=h.rank, pcp=h.pcp, pp=h.pp, layers=list(h.layers),
                          logical=h.logical, physical=h.physical)
            for h in holders
        ],
    )


def from_handle(handle: pb.KVHandle, kv_format: str | None = None) -> KVSource:
    """Decode side: the handle back into planner types. Raises ValueError on an inconsistent handle, and on
    one whose stated rows' format is not ``kv_format`` (the reader's own, engine.kv_format's wire name)."""
    if handle.transport != "mooncake":
        raise ValueError(f"unsupported KV transport {handle.transport!r}")
    if kv_format is not None and handle.kv_format and handle.kv_format != kv_format:
        raise ValueError(f"the KV handle's cache format {handle.kv_format!r} differs from this node's "
                         f"{kv_format!r} (kv_cache_dtype and dtype must match)")
    layouts = {}
    for src in handle.sources:
        regions = {g.layer: LayerRegion(g.layer, g.base, g.num_blocks, g.block_bytes) for g in src.regions}
        layouts[src.rank] = CacheLayout(src.endpoint, regions)
    holders = []
    for h in handle.holders:
        if h.rank not in layouts:
            raise ValueError(f"KV handle names rank {h.rank} as a holder but gives no layout for it")
        if len(h.logical) != len(h.physical):
            raise ValueError(f"KV handle: rank {h.rank}: {len(h.logical)} logical, {len(h.physical)} physical ids")
        layers = list(h.layers)
        span = range(layers[0], layers[-1] + 1) if layers else range(0)
        if layers != list(span):
            raise ValueError(f"KV handle: rank {h.rank}'s layers are not a contiguous range")
        holders.append(RankBlocks(dp=handle.dp_rank, pcp=h.pcp, pp=h.pp, rank=h.rank, layers=span,
                                  logical=list(h.logical), physical=list(h.physical)))
    return KVSource(RequestKV(holders, handle.num_blocks), layouts, handle.prefill_node_id,
                    handle.prefill_address, handle.block_size, handle.lease_s)

"""Layout descriptors: where a rank's KV cache lives in memory, and which blocks a request has where.

A rank registers its cache with the transport as one region per layer: the layer's tensor
``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`` is contiguous, so block ``b`` of a
layer starts at ``base + b · block_bytes``. A request's blocks come from the engine's ownership
query (``engine.parallel.kv_layout.kv_ownership``): per (pcp, pp) rank, the layers it holds and
its (logical, physical) block ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.parallel.kv_layout import RankBlocks


@dataclass(frozen=True)
class LayerRegion:
    """One layer's cache tensor on one rank."""

    layer: int  # global layer index
    base: int  # address of block 0
    num_blocks: int
    block_bytes: int  # block_size · (L + R) · element size

    def __post_init__(self) -> None:
        if self.num_blocks <= 0 or self.block_bytes <= 0:
            raise ValueError(f"layer {self.layer}: num_blocks and block_bytes must be > 0")

    def block_addr(self, block: int) -> int:
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"layer {self.layer}: block {block} outside [0, {self.num_blocks})")
        return self.base + block * self.block_bytes


@dataclass(frozen=True)
class CacheLayout:
    """A rank's registered cache: its transport endpoint and one region per layer it holds."""

    endpoint: str  # the transport's name for the rank (a Mooncake session id: "host:port")
    regions: dict[int, LayerRegion]

    @property
    def layers(self) -> list[int]:
        return sorted(self.regions)

    def region(self, layer: int) -> LayerRegion:
        if layer not in self.regions:
            raise ValueError(f"{self.endpoint} holds no cache for layer {layer} (holds {self.layers})")
        return self.regions[layer]


def describe_cache(endpoint: str, layers: dict[int, torch.Tensor]) -> CacheLayout:
    """The layout of a live cache (``KVCache.layers``: global layer index -> [blocks, bs, L+R])."""
    regions = {}
    for i, t in layers.items():
        if not t.is_contiguous():
            raise ValueError(f"layer {i}: the cache tensor must be contiguous to be registered")
        regions[i] = LayerRegion(i, t.data_ptr(), t.shape[0], t[0].numel() * t.element_size())
    return CacheLayout(endpoint, regions)


@dataclass(frozen=True)
class RequestKV:
    """What is to be moved for one request: its holders and how many logical blocks it has."""

    holders: list[RankBlocks]
    num_blocks: int  # logical blocks [0, num_blocks) of the request to transfer

    def __post_init__(self) -> None:
        for stage in {h.pp for h in self.holders}:
            held = set().union(*(set(h.logical) for h in self.holders if h.pp == stage))
            missing = sorted(set(range(self.num_blocks)) - held)
            if missing:
                raise ValueError(f"PP stage {stage}: no rank holds logical blocks {missing[:8]}")


def restrict(hs: list[RankBlocks], wanted: list[int]) -> RequestKV:
    """The request as the planner sees it for one destination: only the ``wanted`` blocks, renumbered.

    Block ``wanted[k]`` becomes logical block ``k``, so ``dest_blocks[k]`` is its destination block
    (a decode side that already holds a prefix asks for the rest; vLLM's workers for their units).
    """
    index = {j: k for k, j in enumerate(wanted)}
    out = []
    for h in hs:
        pairs = [(index[j], p) for j, p in zip(h.logical, h.physical) if j in index]
        out.append(RankBlocks(h.dp, h.pcp, h.pp, h.rank, h.layers, [k for k, _ in pairs], [p for _, p in pairs]))
    return RequestKV([h for h in out if h.logical], len(wanted))

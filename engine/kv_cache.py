"""Paged latent KV cache: per-layer block tensors and a block allocator with exact accounting.

Layout per layer (vLLM's MLA layout): ``[num_blocks, block_size, row_width]`` of the format's storage
dtype (``engine.kv_format``: ``kv_lora_rank + qk_rope_head_dim`` values, or DeepSeek's FP8 row of bytes).
Block ids index the first dimension of every layer's tensor alike, so one block table per request
serves all layers.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

import torch

from engine.kv_format import KVFormat


class BlockSpace(Protocol):
    """What the scheduler needs from an allocator (one rank's, or a sharded set of ranks')."""

    @property
    def num_used(self) -> int: ...

    @property
    def num_free(self) -> int: ...

    def can_allocate(self, n: int, first: int = 0) -> bool: ...

    def allocate(self, n: int, first: int = 0) -> list[int]: ...

    def free(self, ids: list[int]) -> None: ...


class BlockAllocator:
    """Free list of block ids. ``num_used`` is exact: every id is either free or owned, never both."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def can_allocate(self, n: int, first: int = 0) -> bool:
        """``first`` (the request's first new logical block) matters only to sharded allocators."""
        return n <= len(self._free)

    def allocate(self, n: int, first: int = 0) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV blocks, {len(self._free)} free")
        ids = [self._free.popleft() for _ in range(n)]
        self._used.update(ids)
        return ids

    def free(self, ids: list[int]) -> None:
        for i in ids:
            if i not in self._used:
                raise ValueError(f"block {i} freed twice or never allocated")
            self._used.remove(i)
            self._free.append(i)


def bytes_per_block(fmt: KVFormat, block_size: int, num_layers: int) -> int:
    """What one block costs over ``num_layers`` layers: the stored bytes of its rows."""
    return num_layers * block_size * fmt.row_bytes


class KVCache:
    """The cache tensors of the layers a rank holds, keyed by global layer index."""

    def __init__(
        self,
        fmt: KVFormat,
        layers: range,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        spare_blocks: int = 0,
    ) -> None:
        """``spare_blocks``: blocks after the allocator's ``num_blocks`` that no request ever owns
        (decode CUDA graphs send their padding rows' writes there)."""
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        fmt.check_device(torch.device(device))
        self.block_size = block_size
        self.num_blocks = num_blocks
        total = num_blocks + spare_blocks
        self.layers: dict[int, torch.Tensor] = {
            i: torch.zeros(total, block_size, fmt.row_width, dtype=fmt.storage_dtype, device=device) for i in layers
        }
        self.allocator = BlockAllocator(num_blocks)

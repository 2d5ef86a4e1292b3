"""Source caches for the transfer tests: every held block marked with its layer and logical index."""

from __future__ import annotations

import torch

from engine.parallel.kv_layout import RankBlocks

BS, DIM = 4, 8


def marked_caches(holders: list[RankBlocks], num_blocks: int) -> dict[int, dict[int, torch.Tensor]]:
    """Per source rank, its layers' caches [num_blocks, BS, DIM]: the block holding logical j of
    layer l is filled with 1000·l + j, every other block with -1."""
    caches = {}
    for h in holders:
        layers = {i: torch.full((num_blocks, BS, DIM), -1.0) for i in h.layers}
        for j, b in zip(h.logical, h.physical):
            for i in h.layers:
                layers[i][b] = 1000 * i + j
        caches[h.rank] = layers
    return caches

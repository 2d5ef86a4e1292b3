"""How a node makes the engine's KV cache readable by other processes, without the engine knowing how.

The engine allocates the paged latent cache; a KV transport (``kv_transfer``) has to register that
memory before peers can read it, and it must do so in the process that owns the memory: the rank
process when the model runs on ranks, else the caller's. So the node hands the engine a
``CacheExporter``, picklable before use; the engine calls ``export`` wherever each cache lives, with
that cache's tensors, and returns what it answered (per rank) to the node: ``LLM.cache_exports``.

This is dependency injection across the layers: the exporter travels pickled to the rank processes,
so they import its module (a transport) at run time, while the engine's code imports none.
"""

from __future__ import annotations

from typing import Protocol

import torch


class CacheExporter(Protocol):
    def export(self, layers: dict[int, torch.Tensor]) -> object:
        """Register one cache (global layer index -> [num_blocks, block_size, L + R]); returns a
        picklable description of it for the node (a transport's cache layout)."""
        ...

    def close(self) -> None:
        """Unregister; called where ``export`` ran, when the cache goes away."""
        ...

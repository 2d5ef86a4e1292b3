"""The hash of a full KV block: chained from the prompt's start, stable across processes.

``block_hash(parent, tokens)`` is blake2b over the hash of the block before (or a fixed root for the
first) and the block's token ids, so equal hashes mean equal prefixes up to and including the block.
The engine's prefix cache names its blocks by it (``engine.prefix_cache``) and the proxy computes the
same hashes to guess which prefill replica has a prompt's prefix (``proxy.routing.prefix_index``). Pure
Python: importing it loads no torch.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

_ROOT = b"pdcluster-prefix-v1"


def block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """The hash of a full block of ``tokens`` following the block hashed ``parent`` (None: the first)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(_ROOT if parent is None else parent.to_bytes(8, "little"))
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


def prompt_block_hashes(tokens: Sequence[int], block_size: int, limit: int | None = None) -> list[int]:
    """The chained hashes of the full blocks of ``tokens`` (at most ``limit`` of them)."""
    n = len(tokens) // block_size if limit is None else min(limit, len(tokens) // block_size)
    out: list[int] = []
    parent = None
    for j in range(n):
        parent = block_hash(parent, tokens[j * block_size : (j + 1) * block_size])
        out.append(parent)
    return out

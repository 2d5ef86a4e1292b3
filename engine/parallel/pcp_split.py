"""PCP token split ("DualChunkSwap" / zigzag) and the sharded KV placement.

This step's new tokens of a request are cut into ``2·PCP`` chunks of ``ceil(n / 2·PCP)`` tokens (the
last ones short or empty); PCP rank ``r`` takes chunks ``r`` and ``2·PCP−1−r``, which balances the
causal attention work. Decode rows (one new token) are not split: every PCP rank computes them.
"""

from __future__ import annotations


def zigzag_runs(num_tokens: int, pcp: int, rank: int) -> list[tuple[int, int]]:
    """The (at most two) half-open index runs of this step's new tokens that PCP rank ``rank`` computes."""
    if not 0 <= rank < pcp:
        raise ValueError(f"pcp rank {rank} outside [0, {pcp})")
    chunks = 2 * pcp
    size = -(-num_tokens // chunks)
    runs = [(min(c * size, num_tokens), min((c + 1) * size, num_tokens)) for c in (rank, chunks - 1 - rank)]
    return [(a, b) for a, b in runs if b > a]


def zigzag_indices(num_tokens: int, pcp: int, rank: int) -> list[int]:
    """Indices (0-based within this step's new tokens) that PCP rank ``rank`` computes, ascending."""
    return [i for a, b in zigzag_runs(num_tokens, pcp, rank) for i in range(a, b)]


def kv_owner(position: int, pcp: int, interleave: int) -> int:
    """The PCP rank that stores the KV of token ``position`` in the sharded layout."""
    return (position // interleave) % pcp


def owned_logical_blocks(num_tokens: int, block_size: int, pcp: int, interleave: int, rank: int) -> list[int]:
    """Logical block indices (of a request with ``num_tokens`` tokens) held by PCP rank ``rank``."""
    n_blocks = -(-num_tokens // block_size)
    return [j for j in range(n_blocks) if kv_owner(j * block_size, pcp, interleave) == rank]

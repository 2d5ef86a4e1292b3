"""What one forward step computes: a flat batch of token rows and, per request, where its KV lives.

Rows are laid out decode-first (one row per decoding request, attended in the absorbed form over
the latent cache; a speculative verify step's rows are decode rows too, each attending the cache up to
its own position), then one contiguous segment per prefilling request (decompressed form, the cached
context merged with the new tokens by log-sum-exp).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from engine.kv_format import KVFormat
from engine.parallel.pcp_step import PCPStep

T = TypeVar("T")


@dataclass
class PrefillSegment:
    start: int  # first row of this request in the flat batch
    num_new: int  # rows (new tokens) computed this step
    context_len: int  # tokens of this request already in the cache before this step
    block_table: torch.Tensor  # [num_blocks] int64: blocks covering context + new tokens


class StepMemo:
    """One value the layers of a step share, made by the first layer's call that asks (``get``) and made again
    when asked for from other tensors (compared by identity) or another key."""

    def __init__(self) -> None:
        self._made: tuple[tuple[torch.Tensor, ...], tuple, Any] | None = None

    def get(self, tensors: tuple[torch.Tensor, ...], key: tuple, make: Callable[[], T]) -> T:
        if self._made is not None:
            made_from, made_key, value = self._made
            if made_key == key and len(made_from) == len(tensors) and all(a is b for a, b in zip(made_from, tensors)):
                return value
        value = make()
        self._made = (tensors, key, value)
        return value


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: flat cache slot (block * block_size + offset) per row
    num_decode: int  # rows [0, num_decode) are decode rows
    decode_block_tables: torch.Tensor  # [B, max_blocks] int64 (padded with 0)
    decode_seq_lens: torch.Tensor  # [B] int64: cached tokens incl. this row's token
    decode_max_len: int  # max of decode_seq_lens, known on the host (no device sync to read it)
    prefills: list[PrefillSegment]
    logits_rows: torch.Tensor  # [N] int64: rows whose logits the step needs
    # [B] int32 or None: decode rows that share a block table in aligned groups (a graph's prefill rows;
    # engine.mla_decode's ``grouped``)
    decode_grouped: torch.Tensor | None = None
    # Set on a rank of a parallel replica: this rank's share of the step (engine.parallel.pcp_step).
    pcp: PCPStep | None = None
    # Expert parallelism: every EP rank's rows this step, in group order (the MoE layers' dispatch sizes),
    # found once per step (engine.parallel.expert_parallel); None without EP.
    ep_counts: list[int] | None = None
    # A CUDA graph's step (engine.cuda_graphs): shapes fixed by its size, nothing read back to the host (under
    # expert parallelism the MoE layers then pass every gathered choice through, not only this rank's).
    static: bool = False
    # What the decode attention of this step's layers shares, made by the first layer's call (FlashMLA's schedule:
    # engine.mla_decode_flashmla). A batch lives for one step, or one graph capture; its tensors are not written
    # once it is built.
    decode_memo: StepMemo = field(default_factory=StepMemo)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def slots_for(block_table: torch.Tensor, start: int, end: int, block_size: int) -> torch.Tensor:
    """Flat cache slots of positions [start, end) of a request with this block table."""
    pos = torch.arange(start, end, device=block_table.device)
    return block_table[pos // block_size] * block_size + pos % block_size


def gather_latents(tables: torch.Tensor, pos: torch.Tensor, flat_cache: torch.Tensor, block_size: int,
                   fmt: KVFormat) -> torch.Tensor:
    """Cached latents [B, len(pos), L+R] at positions ``pos`` of each block-table row [B, W], in the
    compute dtype of the cache's format."""
    return fmt.load(flat_cache, tables[:, pos // block_size] * block_size + pos % block_size)

"""One PCP rank's share of a step: what its attention path reads (``pcp_mla``), built from the step's plan
by ``step_plan.build_rank_batch`` and carried on the rank's ``ForwardBatch`` (``ForwardBatch.pcp``).

Plain data, in a module of its own so that ``engine.forward_batch`` can name it without importing the
plan's builder, which makes ``ForwardBatch``es.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.distributed as dist


@dataclass
class SegmentView:
    """One prefill request as seen by one PCP rank."""

    local_rows: slice  # its rows among this rank's local rows
    runs: list[tuple[int, int]]  # which of its new tokens those rows are (ascending zigzag runs)
    new: slice  # its tokens in the step-order tensor of all new prefill tokens
    ctx: slice  # its cached context in the step-order context tensor (empty slice: none)


@dataclass
class PCPStep:
    """Everything the PCP attention path needs for one step on one rank (tensors on its device)."""

    size: int
    rank: int
    group: dist.ProcessGroup | None
    sharded: bool  # KV sharded over the PCP group with size > 1
    num_decode: int
    dec_write_rows: torch.Tensor  # local decode rows whose new KV this rank stores
    dec_write_slots: torch.Tensor
    dec_mask: torch.Tensor  # [B, max_len] bool: cached positions this rank holds, per decode row
    segments: list[SegmentView]
    num_new: int  # new prefill tokens in the step, all ranks
    new_counts: list[int]  # local prefill rows per PCP rank
    new_index: torch.Tensor  # step-order new token -> row of the padded all-gather
    new_write_src: torch.Tensor  # step-order new tokens this rank stores ...
    new_write_slots: torch.Tensor  # ... and where
    num_ctx: int
    ctx_counts: list[int]  # sharded: context tokens each rank reads and contributes
    ctx_read_slots: torch.Tensor  # slots this rank reads (sharded: the ones it holds; replicated: all)
    ctx_index: torch.Tensor | None  # sharded: step-order context token -> row of the padded all-gather
    logits_counts: list[int] = field(default_factory=list)
    logits_index: torch.Tensor | None = None  # plan-order logits row -> row of the padded all-gather

    @cached_property
    def row_counts(self) -> list[int]:
        """Rows per PCP rank this step (every decode row on each, plus its prefill rows), computed once."""
        return [self.num_decode + n for n in self.new_counts]

    def plan_rows(self) -> torch.Tensor:
        """[local rows] int64 on the host: each of this rank's rows' index among the plan's rows flattened in
        plan order (decode rows, then each prefill's new tokens): what the multi-token prediction pass needs
        to find a row's next token (``rank_worker.RankWorker.draft``)."""
        parts = [torch.arange(self.num_decode)]
        for seg in self.segments:
            base = self.num_decode + seg.new.start
            parts += [torch.arange(base + a, base + b) for a, b in seg.runs]
        return torch.cat(parts)

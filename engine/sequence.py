"""Per-request state: tokens, progress through the prompt, KV blocks, and what was sampled.

A request computes its tokens in order: each step takes rows ``[num_computed, num_computed + n)``
of ``token_ids`` (prompt then outputs). When a step reaches the end of ``token_ids`` the last row's
logits sample the next token. Decoding is the case n = 1; chunked prefill is n < remaining.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.sampling_params import SamplingParams
from engine.structured_output import Grammar


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # the resolved budget (params.max_tokens capped by max_model_len)
    eos_token_ids: tuple[int, ...] = ()
    prompt: str | None = None
    status: SeqStatus = SeqStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_top_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    prompt_logits: list[torch.Tensor] = field(default_factory=list)  # filled only when asked (tests)
    want_prompt_logits: bool = False
    hold_kv: bool = False  # keep the KV blocks after finishing (until the engine's release())
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    text: str = ""
    block_hashes: list[int] = field(default_factory=list)  # prefix caching: hashes of full blocks, in order
    num_registered: int = 0  # prefix caching: leading blocks already in the cache
    prefix_hit_blocks: int = 0  # prefix caching: leading blocks it found cached when it (last) started
    prompt_token_set: Any = None  # repetition penalty: the prompt's distinct ids, a tensor made once
    grammar: Grammar | None = None  # structured output: the matcher of what may come next
    cacheable: bool = True  # prefix caching may share its blocks (not when prompt logits are wanted)
    pending: int = 0  # tokens sampled on the device, not yet appended (engine.overlap: the next step runs on them)
    drafts: list[int] = field(default_factory=list)  # speculative decoding: to verify next step (engine.speculative)
    mtp_kv: bool = True  # speculative decoding: the MTP layer's KV of its prompt is here (not so: it never drafts)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, i: int) -> int:
        """``token_ids[i]`` without building the whole list."""
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def tokens(self, start: int, end: int) -> list[int]:
        """``token_ids[start:end]`` without building the whole list."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:n] + self.output_token_ids[max(0, start - n) : end - n]

    @property
    def num_tokens(self) -> int:
        """Tokens so far, those still on the device (``pending``) included."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.pending

    @property
    def num_remaining(self) -> int:
        """Tokens still to compute before the next sample."""
        return self.num_tokens - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status == SeqStatus.FINISHED

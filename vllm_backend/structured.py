"""Structured output on vLLM nodes with the native engine's grammars, as a vLLM logits processor.

vLLM's own structured outputs cannot continue from a token it did not sample: a decode node's prompt
ends with the prefill node's first token (``vllm_backend.decode``), and vLLM's grammar would start
over after it ("b" + "alpha" for the choice ["alpha", "beta"]). So vLLM nodes apply the constraint
as native nodes do (``engine.structured_output``, llguidance), through ``GrammarLogitsProcessor``:
the wire's ``StructuredOutput`` rides in ``SamplingParams.extra_args``, and a decode request first
replays its prompt's last token, the first output, into its matcher. Both backends thus mask with
the same grammar, and a native prefill node's first token always continues on a vLLM decode node.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from cluster.proto_gen import pdcluster_v1_pb2 as pb
from cluster.wire import structured_from_pb
from engine.config import ModelConfig
from engine.structured_output import Grammar, GuidanceTokenizers, mask_rows
from engine.tokenizer import Tokenizer

log = logging.getLogger("pdcluster.vllm")

KEY = "pd_structured_output"  # extra_args: the wire's StructuredOutput, serialized, as hex
REPLAY = "pd_replay_last_prompt_token"  # extra_args: the prompt's last token is the first output


def extra_args(m: pb.StructuredOutput, replay_last_prompt_token: bool) -> dict[str, Any]:
    return {KEY: m.SerializeToString().hex(), REPLAY: replay_last_prompt_token}


@dataclass
class _Row:
    grammar: Grammar
    output: list[int]  # vLLM's running list of the request's output tokens
    seen: int = 0  # how many of them the matcher has taken


class GrammarLogitsProcessor(LogitsProcessor):
    """Masks the rows of requests that carry a constraint in ``extra_args``; the others pass untouched."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self._model = vllm_config.model_config.model
        self._tokenizer_path = vllm_config.model_config.tokenizer or self._model
        self._tokens: GuidanceTokenizers | None = None
        self._rows: dict[int, _Row] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self._rows, batch_update, self._new_row)

    def _new_row(self, params: SamplingParams, prompt: list[int] | None, output: list[int]) -> _Row | None:
        extra = params.extra_args or {}
        if KEY not in extra:
            return None
        if self._tokens is None:
            mc = ModelConfig.from_pretrained(self._model)
            self._tokens = GuidanceTokenizers(Tokenizer(self._tokenizer_path), mc.vocab_size, mc.eos_token_ids)
        grammar = Grammar(self._tokens.get(), structured_from_pb(pb.StructuredOutput.FromString(bytes.fromhex(
            extra[KEY]))))
        if extra.get(REPLAY) and prompt and not grammar.advance(prompt[-1]):
            log.warning("the first output %d breaks the request's structured output (%s)", prompt[-1], grammar.error)
        return _Row(grammar, output)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self._rows:
            return logits
        rows, grammars = [], []
        for index, row in self._rows.items():
            for token in row.output[row.seen:]:
                row.grammar.advance(token)
            row.seen = len(row.output)
            rows.append(index)
            grammars.append(row.grammar)
        return mask_rows(logits, rows, grammars)

"""A request's outputs as its steps produce them: each sampled token appended with its logprobs and the stop
conditions checked (``append_token``: the grammar, stop tokens and EOS past ``min_tokens``, stop strings,
``max_tokens``), prompt logits and logprobs recorded as its prompt's rows are computed
(``record_prompt_logits``), and the text (``detokenize``: cut at the stop string that ended it)."""

from __future__ import annotations

import logging

import torch

from engine.model_runner import StepLogits
from engine.sampler import top_logprobs
from engine.scheduler import Scheduled
from engine.sequence import Sequence
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def append_token(seq: Sequence, token: int, logprob: float, top: dict[int, float] | None,
                 tokenizer: Tokenizer | None) -> str | None:
    """Add a sampled token to ``seq``'s outputs -> the reason it finishes ("stop", "length"), or None. (A request
    with ``max_tokens`` 0 finishes at once, its token not added.)"""
    p = seq.params
    if seq.max_tokens == 0:
        return "length"
    seq.output_token_ids.append(token)
    seq.logprobs.append(logprob)
    if top is not None:
        seq.top_logprobs.append(top)
    reason = None
    if seq.grammar is not None:
        if not seq.grammar.advance(token):  # never with its masks applied: a bug, but not the node's end
            log.warning("request %s: token %d breaks its structured output (%s); stopping it",
                        seq.request_id, token, seq.grammar.error)
            reason = "stop"
        elif seq.grammar.done:
            reason = "stop"  # the grammar is complete: nothing may follow
    n_out = len(seq.output_token_ids)
    if reason is None and n_out >= p.min_tokens:
        if token in (p.stop_token_ids or ()) or (not p.ignore_eos and token in seq.eos_token_ids):
            reason = "stop"
        elif p.stop_strings and tokenizer is not None and _hit_stop_string(seq, tokenizer):
            reason = "stop"
    if reason is None and n_out >= seq.max_tokens:
        reason = "length"
    return reason


def _hit_stop_string(seq: Sequence, tokenizer: Tokenizer) -> bool:
    text = tokenizer.decode(seq.output_token_ids, seq.params.skip_special_tokens)
    for stop in seq.params.stop_strings:
        idx = text.find(stop)
        if idx >= 0:
            seq.text = text[:idx]
            return True
    return False


def detokenize(seq: Sequence, tokenizer: Tokenizer | None) -> str:
    """``seq``'s output text ("" without a tokenizer), up to the stop string that ended it, if one did."""
    if tokenizer is None:
        return ""
    if seq.finish_reason == "stop" and seq.params.stop_strings and seq.text:
        return seq.text
    return tokenizer.decode(seq.output_token_ids, seq.params.skip_special_tokens)


def record_prompt_logits(s: Scheduled, sl: StepLogits | None) -> None:
    """Record prompt logits/logprobs of this step's rows of ``s.seq``, skipping rows recorded before (a
    preempted request recomputes its prompt, perhaps in other chunks)."""
    seq = s.seq
    if sl is None or sl.logits.shape[0] < s.num_new:
        return
    start = seq.num_computed
    rows = min(s.num_new, len(seq.prompt_token_ids) - start)  # rows inside the prompt
    if rows <= 0:
        return  # decode rows (a speculative step's too)
    if seq.want_prompt_logits:
        first = max(0, len(seq.prompt_logits) - start)
        seq.prompt_logits.extend(sl.logits[first:rows].cpu())
    k = seq.params.prompt_logprobs
    if k is None:
        return
    if not seq.prompt_logprobs:
        seq.prompt_logprobs.append(None)  # the first prompt token has no logprob
        seq.prompt_top_logprobs.append(None)
    # Row i predicts prompt token start+i+1; entries so far cover tokens [0, len(prompt_logprobs)).
    first = max(0, len(seq.prompt_logprobs) - start - 1)
    targets = seq.prompt_token_ids[start + first + 1 : start + rows + 1]
    if not targets:
        return
    logp = torch.log_softmax(sl.logits[first : first + len(targets)], dim=-1)
    chosen = logp.gather(1, torch.tensor(targets, device=logp.device).unsqueeze(1)).squeeze(1)
    seq.prompt_logprobs.extend(chosen.tolist())
    seq.prompt_top_logprobs.extend(top_logprobs(logp, k))

"""Token selection: greedy, temperature, top-k, top-p, per-request seeds; logprobs of the raw logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sequence import Sequence


@dataclass
class Sample:
    token: int
    logprob: float
    top: dict[int, float] | None  # top-n logprobs when asked for


def top_logprobs(logp: torch.Tensor, n: int) -> list[dict[int, float]]:
    """logp [N, V] -> per row {token: logprob} of the n most likely tokens."""
    if n <= 0:
        return [{} for _ in range(logp.shape[0])]
    vals, ids = logp.topk(n, dim=-1)
    return [dict(zip(i.tolist(), v.tolist())) for i, v in zip(ids, vals)]


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] -> logits with tokens outside top-k / the top-p nucleus set to -inf."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = logits.topk(top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop_sorted = probs.cumsum(-1) - probs >= top_p
        drop = torch.zeros_like(drop_sorted).scatter_(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(logits: torch.Tensor, seqs: list[Sequence], default_generator: torch.Generator) -> list[Sample]:
    """logits [N, V] fp32, one row per sequence -> one Sample per sequence."""
    logp = torch.log_softmax(logits, dim=-1)
    chosen_logits = logits.clone()
    for i, seq in enumerate(seqs):
        p = seq.params
        if len(seq.output_token_ids) < p.min_tokens:
            banned = list(p.stop_token_ids or []) + ([] if p.ignore_eos else list(seq.eos_token_ids))
            if banned:
                chosen_logits[i, banned] = float("-inf")
    tokens = chosen_logits.argmax(dim=-1)
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.greedy:
            continue
        row = _filter(chosen_logits[i] / p.temperature, p.top_k, p.top_p)
        gen = seq.generator if seq.generator is not None else default_generator
        tokens[i] = torch.multinomial(row.softmax(-1), 1, generator=gen)[0]
    chosen = logp.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
    max_n = max((s.params.logprobs or 0) for s in seqs)
    tops = top_logprobs(logp, max_n) if max_n else [None] * len(seqs)
    out = []
    for i, (seq, tok) in enumerate(zip(seqs, tokens.tolist())):
        top = None
        if seq.params.logprobs is not None:
            n = seq.params.logprobs
            top = dict(list((tops[i] or {}).items())[:n]) if n else {}
        out.append(Sample(token=tok, logprob=chosen[i], top=top))
    return out

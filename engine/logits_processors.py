"""What changes a step's logits before its tokens are chosen: logit bias and vLLM's three penalties.

``apply_bias_and_penalties(logits, seqs)`` returns logits [N, V] where every row whose request asks for
it (``SamplingParams.changes_logits``) has, in vLLM's order:

1. ``logit_bias``: the bias added to each listed token's logit;
2. ``repetition_penalty`` r on every token seen in the prompt or the output so far: a positive logit
   divided by r, a negative one multiplied by it;
3. ``frequency_penalty`` f: minus f times the token's count in the output;
4. ``presence_penalty`` p: minus p for each token present in the output.

Speculative decoding's verify rows (``engine.speculative``) are several rows of one request: each counts the
drafts before it as output too (``ahead``), as decoding them one at a time would.

All rows at once on the logits' device (the counts are one scatter-add over the rows' token ids), so
the greedy argmax and the random draw see the same logits; logprobs are of the raw logits (vLLM's
default, ``engine.sampler``). Rows without any of these are left untouched (and no copy is made when no
row asks).
"""

from __future__ import annotations

import torch

from engine.sequence import Sequence


def apply_bias_and_penalties(logits: torch.Tensor, seqs: list[Sequence],
                             ahead: list[list[int]] | None = None) -> torch.Tensor:
    """``ahead``: per row, tokens taken after its request's output before that row, counted as output tokens
    (a verify row's drafts before it: ``engine.speculative``). Several rows may be one request's: its output
    is counted once and each row adds its own ``ahead``."""
    rows = [i for i, s in enumerate(seqs) if s.params.changes_logits]
    if not rows:
        return logits
    dev, v = logits.device, logits.shape[-1]
    out = logits.clone()
    bias = [(i, t, b) for i in rows for t, b in (seqs[i].params.logit_bias or {}).items() if t < v]
    if bias:
        where = torch.tensor([(i, t) for i, t, _ in bias], device=dev)
        out.index_put_((where[:, 0], where[:, 1]), torch.tensor([b for *_, b in bias], device=dev,
                                                                 dtype=out.dtype), accumulate=True)
    pen = [i for i in rows if _penalized(seqs[i])]
    if not pen:
        return out
    idx = torch.tensor(pen, device=dev)
    owners = list({id(seqs[i]): seqs[i] for i in pen}.values())  # the distinct requests, in order
    place = {id(s): u for u, s in enumerate(owners)}
    counts = _counts([s.output_token_ids for s in owners], v, dev, out.dtype)  # [U, V]
    which = None  # each row's request, where some rows share one
    if len(owners) < len(pen):
        which = torch.tensor([place[id(seqs[i])] for i in pen], device=dev)
        counts = counts[which]  # [P, V]
    if ahead is not None:
        _add_counts(counts, [ahead[i] for i in pen])
    sub = out[idx]
    params = [seqs[i].params for i in pen]
    rep = torch.tensor([p.repetition_penalty for p in params], device=dev, dtype=out.dtype)[:, None]
    if any(p.repetition_penalty != 1 for p in params):
        sets = [_prompt_set(s, v, dev) for s in owners]
        lengths = torch.tensor([len(s) for s in sets], device=dev)
        prompt = torch.zeros(len(owners), v, device=dev, dtype=torch.bool)  # [U, V]: in the request's prompt
        prompt[torch.arange(len(owners), device=dev).repeat_interleave(lengths), torch.cat(sets)] = True
        seen = (counts > 0) | (prompt if which is None else prompt[which])
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    freq = torch.tensor([p.frequency_penalty for p in params], device=dev, dtype=out.dtype)[:, None]
    pres = torch.tensor([p.presence_penalty for p in params], device=dev, dtype=out.dtype)[:, None]
    sub = sub - freq * counts - pres * (counts > 0).to(out.dtype)
    out[idx] = sub
    return out


def _penalized(seq: Sequence) -> bool:
    p = seq.params
    return p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1


def _prompt_set(seq: Sequence, vocab: int, dev: torch.device) -> torch.Tensor:
    """The prompt's distinct token ids on ``dev`` (made at the request's first penalized step)."""
    ids = seq.prompt_token_set
    if ids is None or ids.device != dev:
        ids = seq.prompt_token_set = torch.tensor(sorted({t for t in seq.prompt_token_ids if 0 <= t < vocab}),
                                                  device=dev, dtype=torch.long)
    return ids


def _counts(ids: list[list[int]], vocab: int, dev: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[len(ids), vocab]: how often each token occurs in each row's ids (ids outside the vocabulary skipped)."""
    return _add_counts(torch.zeros(len(ids), vocab, device=dev, dtype=dtype), ids)


def _add_counts(counts: torch.Tensor, ids: list[list[int]]) -> torch.Tensor:
    """``counts`` [len(ids), V] plus each row's ids' occurrences, in place (one scatter-add)."""
    vocab, dev = counts.shape[-1], counts.device
    flat = [(r, t) for r, row in enumerate(ids) for t in row if 0 <= t < vocab]
    if flat:
        where = torch.tensor(flat, device=dev)
        counts.index_put_((where[:, 0], where[:, 1]), torch.ones(len(flat), device=dev, dtype=counts.dtype),
                          accumulate=True)
    return counts

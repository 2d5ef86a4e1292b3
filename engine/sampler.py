"""Token selection: greedy, temperature, min-p, top-k, top-p, per-request seeds; logprobs of the raw logits.

Logit bias and penalties change the logits first (``engine.logits_processors``), for greedy rows too, then
a request's grammar masks the tokens it does not allow (``engine.structured_output``).

A step's rows are sampled together on the logits' device (a GPU on GPU nodes): no loop of kernels per
row except one noise draw per seeded request, and one wait for the host at the end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.logits_processors import apply_bias_and_penalties
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.structured_output import mask_logits


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


def _filter_sorted(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits [R, V] with per-row top_k [R] (V = off) and top_p [R] (1 = off) -> logits with the tokens
    outside each row's top-k and top-p nucleus set to -inf (one sort for all rows)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)
    drop = rank[None, :] >= top_k[:, None]
    # top-p over what top-k kept, renormalised (as vLLM and transformers apply them): keep the smallest
    # prefix whose mass reaches top_p (the first token always stays)
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    drop |= probs.cumsum(-1) - probs >= top_p[:, None]
    return torch.empty_like(logits).scatter_(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def processed_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits [R, V] -> the distributions [R, V] a token is drawn from: temperature, min-p, top-k, top-p,
    row i by ``params[i]`` (temperature > 0), all rows at once on the logits' device."""
    dev, v = logits.device, logits.shape[-1]
    sub = logits / torch.tensor([p.temperature for p in params], device=dev)[:, None]
    if any(p.min_p > 0 for p in params):  # tokens below min_p x the most likely one's probability
        probs = sub.softmax(-1)
        floor = probs.amax(-1, keepdim=True) * torch.tensor([p.min_p for p in params], device=dev,
                                                            dtype=probs.dtype)[:, None]
        sub = sub.masked_fill(probs < floor, float("-inf"))
    if any(0 < p.top_k < v or p.top_p < 1.0 for p in params):
        ks = torch.tensor([p.top_k if 0 < p.top_k < v else v for p in params], device=dev)
        sub = _filter_sorted(sub, ks, torch.tensor([p.top_p for p in params], device=dev, dtype=sub.dtype))
    return sub.softmax(-1)


def _sample_random(logits: torch.Tensor, seqs: list[Sequence], rows: list[int],
                   default_generator: torch.Generator) -> torch.Tensor:
    """Token ids [len(rows)] drawn for the given rows of logits [N, V] (``processed_probs``); the draw is an
    exponential race (argmax of p / E, E ~ Exp(1)), its noise from each seeded request's own generator (so
    neighbours never change its draw) and from ``default_generator`` for the rest."""
    dev, v = logits.device, logits.shape[-1]
    probs = processed_probs(logits[torch.tensor(rows, device=dev)], [seqs[i].params for i in rows])
    noise = torch.empty_like(probs)
    shared = [j for j, i in enumerate(rows) if seqs[i].generator is None]
    if shared:
        draw = torch.empty(len(shared), v, device=dev, dtype=probs.dtype).exponential_(generator=default_generator)
        noise[torch.tensor(shared, device=dev)] = draw
    for j, i in enumerate(rows):
        gen = seqs[i].generator
        if gen is not None:
            noise[j].exponential_(generator=gen)
    return (probs / noise).argmax(dim=-1)


def stop_ids(seq: Sequence) -> list[int]:
    """The tokens banned while ``min_tokens`` is not reached: ``stop_token_ids`` and the eos ones (unless
    ``ignore_eos``)."""
    p = seq.params
    return list(p.stop_token_ids or []) + ([] if p.ignore_eos else list(seq.eos_token_ids))


def sample(logits: torch.Tensor, seqs: list[Sequence], default_generator: torch.Generator) -> list[Sample]:
    """logits [N, V] fp32, one row per sequence -> one Sample per sequence.

    Everything runs on the logits' device; the host waits once, for one copy of the chosen ids, their
    logprobs and the top logprobs asked for."""
    return launch_sample(logits, seqs, default_generator).result()


class PendingSamples:
    """A step's samples on their way to the host: ``tokens`` [N] (long, on the device) may feed the next
    step before ``result()`` waits for them (engine.overlap)."""

    def __init__(self, tokens: torch.Tensor, packed: torch.Tensor, seqs: list[Sequence], max_n: int) -> None:
        self.tokens = tokens
        self._seqs = seqs
        self._max_n = max_n
        self._event: torch.cuda.Event | None = None
        if packed.is_cuda:  # copied behind the step's kernels; the host waits only in result()
            with torch.cuda.device(packed.device):  # (an engine's thread need not have its device current)
                self._host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
                self._host.copy_(packed, non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record(torch.cuda.current_stream(packed.device))
        else:
            self._host = packed

    def result(self) -> list[Sample]:
        if self._event is not None:
            self._event.synchronize()  # the step's one wait for the device
        host = self._host.tolist()
        n, max_n = len(self._seqs), self._max_n
        out = []
        for i, seq in enumerate(self._seqs):
            top = None
            if seq.params.logprobs is not None:
                k = seq.params.logprobs
                ids = host[2 * n + i * max_n : 2 * n + i * max_n + k]
                vals = host[2 * n + n * max_n + i * max_n : 2 * n + n * max_n + i * max_n + k]
                top = {int(t): v for t, v in zip(ids, vals)}
            out.append(Sample(token=int(host[i]), logprob=host[n + i], top=top))
        return out


def launch_sample(logits: torch.Tensor, seqs: list[Sequence], default_generator: torch.Generator) -> PendingSamples:
    """``sample`` without waiting: the choice is queued on the logits' device."""
    dev = logits.device
    logp = torch.log_softmax(logits, dim=-1)  # logprobs of the raw logits (vLLM's default)
    chosen_logits = apply_bias_and_penalties(logits, seqs)
    # min_tokens bans the stop tokens, unless the request's grammar could end here (it decides then)
    banned = [(i, t) for i, seq in enumerate(seqs) if len(seq.output_token_ids) + seq.pending < seq.params.min_tokens
              and (seq.grammar is None or not seq.grammar.accepting) for t in stop_ids(seq)]
    if banned:
        chosen_logits = chosen_logits.clone() if chosen_logits is logits else chosen_logits
        where = torch.tensor(banned, device=dev)
        chosen_logits[where[:, 0], where[:, 1]] = float("-inf")
    if any(seq.grammar is not None for seq in seqs):
        chosen_logits = mask_logits(chosen_logits.clone() if chosen_logits is logits else chosen_logits,
                                    [seq.grammar for seq in seqs])
    tokens = chosen_logits.argmax(dim=-1)
    random_rows = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
    if random_rows:
        tokens[torch.tensor(random_rows, device=dev)] = _sample_random(chosen_logits, seqs, random_rows,
                                                                       default_generator)
    max_n = max((s.params.logprobs or 0) for s in seqs)
    parts = [tokens.to(torch.float64), logp.gather(1, tokens.unsqueeze(1)).squeeze(1).to(torch.float64)]
    if max_n:
        top_vals, top_ids = logp.topk(max_n, dim=-1)
        parts += [top_ids.to(torch.float64).flatten(), top_vals.to(torch.float64).flatten()]
    return PendingSamples(tokens, torch.cat(parts), list(seqs), max_n)

"""Speculative decoding with the model's multi-token prediction (MTP) layer (``engine.model.MTPLayer``).

``speculative_config`` takes vLLM's form, ``{"method": "mtp", "num_speculative_tokens": k}`` (k >= 1; the
one MTP layer is run k times for k > 1). A request's step, in order:

1. **Verify.** A decoding request with drafts ``d1..dj`` (j <= k) is scheduled ``1 + j`` rows: its last
   token and the drafts, at the positions they would take. The target computes all rows' logits in one
   step, each row a decode row attending the cache up to its own position.
2. **Accept.** Row i's logits are first changed as the sampler changes a decode row's after the output so
   far and ``d1..di``: a request's ``logit_bias`` added, its penalties applied with ``d1..di`` counted as
   output, its stop tokens banned while ``len(output) + i < min_tokens``, and its grammar's mask after its
   tokens so far and ``d1..di`` applied (below).
   Greedy: the target's token at row i is ``t_i``; the drafts are accepted while
   ``d_{i+1} == t_i``, then the target's own token follows (the bonus): the tokens are ``d1..da, t_a``,
   exactly what decoding them one step at a time would give. Sampled (temperature > 0): rejection
   sampling with the draft as a point mass, so the tokens follow the target's distribution exactly:
   ``d_{i+1}`` is accepted with probability ``p_i(d_{i+1})`` (``p_i``: row i's distribution after those
   changes, temperature, min-p, top-k, top-p); at the first rejection a token is drawn from ``p_i`` without
   ``d_{i+1}`` (the residual ``max(p_i - q, 0)``, renormalised), and when all are accepted the bonus is
   drawn from the last row's ``p``; the uniforms and draws come from the request's generator when it is
   seeded. ``num_computed`` advances by ``1 + a``: the KV of the rejected rows stays in slots past it,
   overwritten when those positions are computed again.
3. **Draft.** The MTP layer runs over every row of the step (its KV follows the target's), each row
   with the target's hidden state there and the token after it; the row of the last accepted position
   predicts the next draft, and the layer runs again, one row at a time, for the rest.

Structured output: the grammar checks the drafts as they are made (and again before they are verified): one
it does not allow at its position ends them there, and so does one after which the output is complete
(``grammar_drafts``, ``Grammar.draftable``), so a forbidden token is never scheduled or verified. To verify,
the matcher is advanced through the drafts to fill each row's mask and rolled back (``mask_drafted``, all
grammar requests' rows in one bitmask on llguidance's threads); the accepted tokens then advance it one by
one as single-token decoding's do (``LLMEngine._append``). So greedy outputs equal decoding without drafts,
and sampled ones follow the target's masked distribution. A ``logit_bias`` does not depend on the tokens
before a row: it is added to every row.

Penalties and ``min_tokens`` depend on the tokens before a row, and every row knows them: the output so far and
the drafts before it. ``_chosen_logits`` counts the request's output once and adds each row's drafts before
it (``apply_bias_and_penalties``' ``ahead``: one scatter-add for all rows), the prompt's tokens for
``repetition_penalty`` as the sampler takes them; row i bans the stop tokens (``stop_token_ids`` and eos)
while ``len(output) + i < min_tokens``, unless the grammar accepts the output after ``d1..di``
(``Grammar.accepting_after``), the sampler's exception. A stop token drafted where it is banned is never
accepted (greedy: the target cannot choose it; sampled: its probability is 0). Logprobs (and the top ones
asked for) of every token come from its row's raw logits, as the sampler's do without drafts.

A prefill node with ``speculative_config`` runs the MTP layer over the prompt and hands its (grammar-checked)
draft and the layer's KV to the decode side (``LLMEngine.admit_prefilled``), which verifies it at its first
step. A decode side with it fed by one without it (no MTP layer KV came) computes the prompt and the first token
again itself, as a preempted request is (``mtp_recompute``, on by default), and drafts from the step after;
with ``mtp_recompute`` off the request decodes without drafts.

On rank processes (DP > 1, PCP, PP: ``engine.parallel``) the last PP stage holds the MTP layer and its cache
layer; after each step that stage's PCP ranks run it over their own rows of the step (``RunDraft``), its
attention the PCP attention of every other layer, so its KV is sharded (or replicated) as theirs, and the
rank that computed a prompt's last row has the draft. A held request's one draft goes to the decode side with
the layer's KV. Requests that go on decoding on the ranks draft there too: a verify step's rows are a chunk of
the request split over the PCP ranks as a prompt's, ``RunDraft`` picks the last accepted row, and for k > 1 the
ranks run the layer again, one decode row a drafting request a pass (every PCP rank alike, the picks' hidden
states shared first). Across DP replicas stepping in lockstep (EP across them: the deferred drafts below) every
replica's ranks run each further pass together, their rows in it exchanged first (a replica whose requests draft
less far, or not at all, runs only the pass's MoE collectives).

Under expert parallelism a decode node's DP replicas (an engine each, one EP group stepping in lockstep:
``engine.parallel.expert_parallel.ExpertGroup``) draft as any engine does: the MTP layer's routed experts are
sharded as every layer's, and its MoE dispatches over the group in each of the layer's passes. After every step
with rows on any replica every replica runs the passes (``ModelRunner.draft``; one without rows calls it with
none): their rows per pass exchanged once (``ExpertGroup.pass_counts``), the first pass over the step's rows,
each further one over the requests drafting that far, and a replica without rows in a pass runs only its MoE's
collectives. The passes run eagerly, also after a step replayed as a CUDA graph (their sizes change every
step). On rank processes the last stage's MTP layer dispatches over the stage's EP group with the step's
counts (its rows are the step's): with EP over PCP ranks (dp = 1) its ranks run ``RunDraft`` together anyway;
across DP replicas (dp > 1, stepping in lockstep) every replica's ranks must run it together, so the drafts are
asked for as each replica's step finishes and taken once every replica's is (``Drafts(deferred=True)``,
``LLMEngine.settle_drafts``, which the callers that step the replicas call after finishing them all).

Prefix caching: the MTP layer's KV at a block's last position depends on the first token of the next block,
which the block's hash does not cover, so a prompt that hits the cache recomputes (or pulls) the last block
it matched (``Scheduler.spare_blocks``); a request admitted without the layer's KV shares none of its blocks.

CUDA graphs: the verify rows replay from the graphs of token rows (``engine.cuda_graphs``) and the MTP passes
after such a replay from graphs of their own (``engine.mtp_graphs``; eager under EP). Greedy requests are verified
in one batch (``_greedy_verdicts``: one argmax and one gather over all their rows, one copy to the host).

Overlapped steps (``async_scheduling``, a GPU's default): a step's rows are known on the host once the last
step's tokens are verified (how many drafts were accepted decides its positions), so it cannot be launched
before that (``engine.overlap``'s way). It is launched ahead instead: right after the verification, before the
caller (a decode node's loop) takes the finished requests and delivers the step's tokens, which then overlaps
the GPU's next step (``LLMEngine.spec_ahead``; not in EP lockstep, where the members launch together). Its
drafts need not reach the host first: where no drafting request has a grammar (whose cut of the drafts would
change the step's rows) the MTP passes leave them on the device (``ModelRunner.draft_ahead``, ``DraftsInFlight``),
each request holds placeholders of their number, the step is scheduled and launched while the passes run, its
verify rows reading the drafts where the passes wrote them (``Drafts.feed``, an ``engine.overlap.Feed``), and
they land on the host after (``Drafts.land``: a wait for the passes alone), with the blocks freed meanwhile
(``LLMEngine._land``). The GPU then runs the passes and the next step back to back.

Not done: the grammar's mask, bias and penalties on the MTP layer's own choice (it takes its argmax over the
whole vocabulary; the grammar then cuts a draft it forbids). Measured on the trained tiny model (docs/benchmarks.md,
2026-12-05 late night), choosing the drafts as the sampler would change the logits saved 4-5% of the steps under a
regex and none under penalties, while it would take those steps off the MTP graphs' path: not kept.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch

from engine.logits_processors import apply_bias_and_penalties
from engine.overlap import Feed
from engine.sampler import processed_probs, stop_ids, top_logprobs
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.structured_output import Grammar, mask_drafted

METHODS = ("mtp",)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {METHODS}, got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")

    @staticmethod
    def parse(text: str) -> SpeculativeConfig:
        """vLLM's JSON form: ``{"method": "mtp", "num_speculative_tokens": k}``."""
        try:
            raw: Any = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config is not JSON: {e}") from None
        if not isinstance(raw, dict) or set(raw) - {"method", "num_speculative_tokens"}:
            raise ValueError('speculative_config must be {"method": "mtp", "num_speculative_tokens": k}, '
                             f"got {text!r}")
        k = raw.get("num_speculative_tokens", 1)
        if not isinstance(k, int) or isinstance(k, bool):
            raise ValueError(f"num_speculative_tokens must be an integer, got {k!r}")
        return SpeculativeConfig(str(raw.get("method", "")), k)


def grammar_drafts(seq: Sequence, drafts: list[int]) -> list[int]:
    """The leading drafts the request's grammar takes, one after another (all of them without a grammar): a
    draft it does not allow at its position ends them, and so does one after which the output is complete."""
    return drafts if seq.grammar is None else drafts[: seq.grammar.draftable(drafts)]


def draft_budget(seq: Sequence, k: int, max_model_len: int) -> int:
    """How many drafts the request can use next step: at most ``k``, and none past its token budget or
    the model's length (a step of 1 + j rows may produce j + 1 tokens)."""
    left = min(seq.max_tokens - len(seq.output_token_ids), max_model_len - seq.num_tokens) - 1
    return max(0, min(k, left))


def verify(logits: torch.Tensor, drafts: list[int], params: SamplingParams,
           generator: torch.Generator) -> tuple[int, list[int]]:
    """A verify step's rows of one request, logits [1 + len(drafts), V] -> (drafts accepted, the tokens to
    append: the accepted drafts and one more), greedy or by rejection sampling (module docstring)."""
    if params.greedy:
        target = logits.argmax(-1).tolist()
        a = accepted(drafts, target)
        return a, drafts[:a] + [target[a]]
    probs = processed_probs(logits, [params] * logits.shape[0])
    for i, d in enumerate(drafts):
        if torch.rand((), generator=generator, device=probs.device) < probs[i, d]:
            continue
        residual = probs[i].clone()
        residual[d] = 0.0
        return i, drafts[:i] + [_draw(residual, generator)]
    return len(drafts), drafts + [_draw(probs[-1], generator)]


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """A token from ``probs`` [V] (unnormalised), by the sampler's exponential race."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())


def accepted(drafts: list[int], target: list[int]) -> int:
    """How many leading drafts the target's tokens confirm: ``drafts[i] == target[i]`` (``target[i]``:
    the target's token after row i, whose input is the token before ``drafts[i]``)."""
    a = 0
    while a < len(drafts) and drafts[a] == target[a]:
        a += 1
    return a


@dataclass
class SpecCounts:
    """An engine's drafts since start, for its metrics: verify steps, draft tokens, accepted ones."""

    steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def add(self, drafts: int, accepted: int) -> None:
        self.steps += 1
        self.draft_tokens += drafts
        self.accepted_tokens += accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verify step: the accepted drafts and the target's own (vLLM's mean acceptance length)."""
        return 1 + self.accepted_tokens / self.steps if self.steps else 0.0


# What the engine's parts look like from here (engine_config imports this module, so it imports none of them):
class Rows(Protocol):
    """A scheduled request's rows this step (``engine.scheduler.Scheduled``)."""

    seq: Sequence
    num_new: int
    drafts: list[int]


class RowLogits(Protocol):
    """Their logits (``engine.model_runner.StepLogits``): [rows, V]."""

    logits: torch.Tensor


class Blocks(Protocol):
    """The scheduler's block keeping (``engine.scheduler.Scheduler``)."""

    spare_blocks: int

    def grow(self, seq: Sequence, num_new: int) -> bool: ...

    def cache_computed(self, seq: Sequence) -> None: ...


class Drafter(Protocol):
    """The executor's half (``LocalExecutor.draft``, ``ModelRunner.draft``; on rank processes
    ``engine.parallel.replica.ReplicaExecutor.draft``)."""

    def draft(self, next_ids: list[int], picks: list[int], extra: list[int],
              tables: list[list[int]]) -> list[list[int]]: ...


@dataclass
class DraftsInFlight:
    """Drafts made on the device and on their way to the host (``ModelRunner.draft_ahead``): ``tokens`` [picks, k]
    on the device, pick i's first ``lengths[i]`` in row i, which a step launched before they land reads there
    (``Drafts.feed``). ``result`` gives them on the host: ``known`` where the passes already brought them (eager),
    else once the copy into ``host`` (pinned) that ``ready`` marks is done, a wait for the passes alone, not for
    the work queued after them (without either: ``tokens`` read then, on a CPU)."""

    tokens: torch.Tensor
    lengths: list[int]
    known: list[list[int]] | None = None
    host: torch.Tensor | None = None
    ready: Any = None  # a torch.cuda.Event

    def result(self) -> list[list[int]]:
        if self.known is not None:
            return self.known
        if self.ready is not None:
            self.ready.synchronize()
        rows = (self.host if self.host is not None else self.tokens).tolist()
        return [row[:n] for row, n in zip(rows, self.lengths)]


class AheadDrafter(Drafter, Protocol):
    """An executor whose drafts can stay on the device while the next step is launched (``LocalExecutor``)."""

    def draft_ahead(self, next_ids: list[int], picks: list[int], extra: list[int],
                    tables: list[list[int]]) -> DraftsInFlight: ...


class DeferredDrafter(Drafter, Protocol):
    """An executor whose drafts can be asked for and taken in two halves (``ReplicaExecutor``: the MTP layer of DP
    replicas stepping in lockstep on rank processes dispatches over all of them, so every replica's ranks must be
    asked before any answer is awaited)."""

    def launch_draft(self, next_ids: list[int], picks: list[int], extra: list[int] | None = None,
                     tables: list[list[int]] | None = None) -> None: ...

    def collect_drafts(self) -> list[list[int]]: ...


Append = Callable[[Sequence, int, float, "dict[int, float] | None"], bool]  # the engine's: True when it finished


class Drafts:
    """One engine's speculative decoding: a step's drafts verified (``verify``), the next ones made (``draft``)."""

    def __init__(self, config: SpeculativeConfig, scheduler: Blocks, executor: Drafter,
                 max_model_len: int, deferred: bool = False) -> None:
        """``deferred``: ``draft`` only asks the executor (a ``DeferredDrafter``) for the drafts, ``settle``
        takes them."""
        self.k = config.num_speculative_tokens
        self.scheduler = scheduler
        self.executor = executor
        self.max_model_len = max_model_len
        self.counts = SpecCounts()
        self.deferred = deferred
        self._asked: list[Sequence] | None = None  # deferred: the requests whose drafts are asked for
        self._flight: tuple[list[Sequence], DraftsInFlight] | None = None  # ``draft(ahead=True)``'s, until ``land``
        scheduler.spare_blocks = 1  # (module docstring: prefix caching)

    def verify(self, scheduled: Sequence_[Rows], logits: Sequence_[RowLogits | None], generator: torch.Generator,
               append: Append) -> list[Sequence]:
        """Each request's accepted drafts and one more token appended; returns the requests that finished."""
        todo: list[tuple[Sequence, torch.Tensor, list[int]]] = []
        for s, sl in zip(scheduled, logits):
            if s.drafts and not s.seq.is_finished:
                assert sl is not None
                # Cut to the grammar's when made (its state unchanged since); checked again where it matters.
                drafts = grammar_drafts(s.seq, s.drafts)
                todo.append((s.seq, sl.logits[: 1 + len(drafts)], drafts))
        finished = []
        chosen = _chosen_logits(todo)
        greedy = _greedy_verdicts(todo, chosen)
        for (seq, raw, drafts), rows, verdict in zip(todo, chosen, greedy):
            if verdict is not None:  # the tokens and their logprobs from the batch's one copy to the host
                a, tokens, chosen_lp = verdict
            else:
                a, tokens = verify(rows, drafts, seq.params, seq.generator or generator)
                chosen_lp = None
            self.counts.add(len(drafts), a)
            seq.drafts = []  # verified: the next ones come from draft()
            seq.num_computed += a
            # Token j came from row j: its logprob (and the top ones asked for) of that row's raw logits.
            n = seq.params.logprobs
            if chosen_lp is None or n is not None:
                logp = torch.log_softmax(raw[: len(tokens)], dim=-1)
                chosen_lp = logp.gather(1, torch.tensor(tokens, device=logp.device).unsqueeze(1)).squeeze(1).tolist()
            tops = top_logprobs(logp, n) if n is not None else [None] * len(tokens)
            for token, lp, top in zip(tokens, chosen_lp, tops):
                if append(seq, token, lp, top):
                    finished.append(seq)
                    break
            else:
                self.scheduler.cache_computed(seq)
        return finished

    def draft(self, scheduled: Sequence_[Rows], starts: list[int], ahead: bool = False) -> None:
        """The MTP layer over the step's rows (``starts``: each request's first row's position), and the next
        drafts of the requests that decode on. ``ahead`` (the engine launches the next step before it takes the
        drafts): where no drafting request has a grammar (which may cut its drafts, and so its next step's rows)
        they stay on the device (``in_flight``) and each request holds placeholders of their number, for the
        next step's verify rows (``feed``) until ``land``."""
        if not scheduled:
            return
        next_ids: list[int] = []
        picks: list[int] = []
        extra: list[int] = []
        drafting: list[Sequence] = []
        row = 0
        for s, first in zip(scheduled, starts):
            seq = s.seq
            seq.drafts = []
            known = len(seq.prompt_token_ids) + len(seq.output_token_ids)
            after = seq.tokens(first + 1, min(first + 1 + s.num_new, known))  # the token after each row ...
            next_ids += after + [0] * (s.num_new - len(after))  # ... unknown past the last: unused
            if seq.is_finished:  # a prefill node's held request: one draft, for the decode side (no blocks more)
                budget = int(seq.hold_kv and bool(seq.block_ids) and seq.finish_reason == "length")
            else:
                budget = draft_budget(seq, self.k, self.max_model_len) \
                    if seq.num_remaining == 1 and seq.mtp_kv else 0
            # Further drafts write the MTP layer's KV one position on each: their blocks first.
            while budget > 1 and not self.scheduler.grow(seq, budget - 1):
                budget -= 1
            if budget:
                picks.append(row + seq.num_computed - 1 - first)  # the last computed position: its next token is new
                extra.append(budget - 1)
                drafting.append(seq)
            row += s.num_new
        tables = [q.block_ids for q in drafting]
        if self.deferred:
            cast(DeferredDrafter, self.executor).launch_draft(next_ids, picks, extra, tables)
            self._asked = drafting
            return
        if ahead and drafting and all(q.grammar is None for q in drafting):
            flight = cast(AheadDrafter, self.executor).draft_ahead(next_ids, picks, extra, tables)
            for seq, e in zip(drafting, extra):
                seq.drafts = [0] * (1 + e)
            self._flight = (drafting, flight)
            return
        drafts = self.executor.draft(next_ids, picks, extra, tables)
        for seq, d in zip(drafting, drafts):
            seq.drafts = grammar_drafts(seq, d)  # (the blocks grown for any cut stay the request's, as ever)

    @property
    def in_flight(self) -> bool:
        return self._flight is not None

    def feed(self, scheduled: Sequence_[Rows]) -> Feed | None:
        """The verify rows of ``scheduled`` (a step about to be launched) whose drafts are still on the device
        (``draft(ahead=True)``), to be written there from the drafts' own tensor (None: no such rows)."""
        if self._flight is None:
            return None
        drafting, flight = self._flight
        where = {id(q): i for i, q in enumerate(drafting)}
        k = flight.tokens.shape[1]
        rows: list[int] = []
        src: list[int] = []
        row = 0
        for s in scheduled:
            i = where.get(id(s.seq))
            if i is not None and s.drafts:  # a verify step's rows: the last token, then the drafts
                rows += range(row + s.num_new - len(s.drafts), row + s.num_new)
                src += range(i * k, i * k + len(s.drafts))
            row += s.num_new
        return Feed(flight.tokens.view(-1), rows, src) if rows else None

    def land(self, scheduled: Sequence_[Rows]) -> None:
        """The drafts in flight reach the host: each request's, and the verify rows of ``scheduled`` (the step
        launched on them, if any) hold them in place of the placeholders."""
        if self._flight is None:
            return
        drafting, flight = self._flight
        self._flight = None
        for seq, d in zip(drafting, flight.result(), strict=True):
            if seq.drafts:  # (none: preempted while they flew, by the scheduling of the next step)
                seq.drafts = d
        landed = {id(q) for q in drafting}
        for s in scheduled:
            if s.drafts and id(s.seq) in landed:
                s.drafts = s.seq.drafts[: len(s.drafts)]

    def idle(self) -> None:
        """A step without rows in lockstep (EP across DP replicas): the MTP layer's pass runs anyway, for the
        other replicas' rows (its MoE's collectives)."""
        if self.deferred:
            cast(DeferredDrafter, self.executor).launch_draft([], [])
            self._asked = []
        else:
            self.executor.draft([], [], [], [])

    def settle(self) -> None:
        """Deferred: take the drafts asked for by the last ``draft`` (or ``idle``) and give them to their requests."""
        asked, self._asked = self._asked, None
        if asked is None:
            return
        drafts = cast(DeferredDrafter, self.executor).collect_drafts()
        for seq, d in zip(asked, drafts, strict=True):
            seq.drafts = grammar_drafts(seq, d)


def _greedy_verdicts(todo: Sequence_[tuple[Sequence, torch.Tensor, list[int]]],
                     chosen: list[torch.Tensor]) -> list[tuple[int, list[int], list[float]] | None]:
    """The greedy requests' verdicts, all in one batch (``verify``'s, per request, cost two host syncs each):
    per request (drafts accepted, tokens, each token's logprob of its row's raw logits); None for a sampled
    one. Greedy row j's token is the target's own (an accepted draft equals it), so one argmax over every
    greedy row of the step and one gather of the raw logits' log-softmax there give them all."""
    greedy = [j for j, (seq, _, _) in enumerate(todo) if seq.params.greedy]
    out: list[tuple[int, list[int], list[float]] | None] = [None] * len(todo)
    if not greedy:
        return out
    target = torch.cat([chosen[j] for j in greedy]).argmax(-1)
    logp = torch.log_softmax(torch.cat([todo[j][1] for j in greedy]), dim=-1)
    both = torch.stack([target.double(), logp.gather(1, target.unsqueeze(1)).squeeze(1).double()]).tolist()
    row = 0
    for j in greedy:
        drafts = todo[j][2]
        tokens = [int(t) for t in both[0][row : row + 1 + len(drafts)]]
        a = accepted(drafts, tokens)
        out[j] = (a, tokens[: a + 1], both[1][row : row + a + 1])
        row += 1 + len(drafts)
    return out


def _chosen_logits(todo: Sequence_[tuple[Sequence, torch.Tensor, list[int]]]) -> list[torch.Tensor]:
    """The logits each request's verify rows choose from (``todo``: request, rows' raw logits [1 + j, V], its
    j drafts): the raw ones, or, for a request with a bias, penalties, a ``min_tokens`` still to reach or a
    grammar, a copy with row i changed as the sampler would change a decode row's after ``d1..di``: the bias
    added, the penalties counting ``d1..di`` as output, the stop tokens banned while ``len(output) + i`` is
    short of ``min_tokens`` (unless the grammar accepts the output there) and the grammar's mask after
    ``d1..di`` applied. Those requests' rows go as one batch (one scatter-add of the counts, one bitmask
    filled on llguidance's threads)."""
    out = [raw for _, raw, _ in todo]
    changed = [j for j, (seq, _, _) in enumerate(todo)
               if seq.grammar is not None or seq.params.changes_logits or _stops_banned(seq)]
    if not changed:
        return out
    seqs: list[Sequence] = []  # each row's request ...
    ahead: list[list[int]] = []  # ... and the drafts before the row
    banned: list[tuple[int, int]] = []  # (row, stop token) while min_tokens is not reached
    starts: list[int] = []  # the first row of each request with a grammar, its grammar and drafts
    grammars: list[Grammar] = []
    drafts: list[list[int]] = []
    for j in changed:
        seq, raw, d = todo[j]
        first = len(seqs)
        if seq.grammar is not None:
            starts.append(first)
            grammars.append(seq.grammar)
            drafts.append(d)
        if _stops_banned(seq):  # rows i with len(output) + i < min_tokens
            n = min(raw.shape[0], seq.params.min_tokens - len(seq.output_token_ids) - seq.pending)
            free = seq.grammar.accepting_after(d[: n - 1]) if seq.grammar is not None else [False] * n
            banned += [(first + i, t) for i in range(n) if not free[i] for t in stop_ids(seq)]
        seqs += [seq] * raw.shape[0]
        ahead += [d[:i] for i in range(raw.shape[0])]
    # a copy (torch.cat), biased and penalised; then banned and masked in place
    stacked = apply_bias_and_penalties(torch.cat([todo[j][1] for j in changed]), seqs, ahead)
    if banned:
        where = torch.tensor(banned, device=stacked.device)
        stacked[where[:, 0], where[:, 1]] = float("-inf")
    if grammars:
        mask_drafted(stacked, starts, grammars, drafts)
    for j, part in zip(changed, stacked.split([todo[j][1].shape[0] for j in changed])):
        out[j] = part
    return out


def _stops_banned(seq: Sequence) -> bool:
    """Whether the request's ``min_tokens`` bans its stop tokens at its next token (the sampler's rule)."""
    return len(seq.output_token_ids) + seq.pending < seq.params.min_tokens

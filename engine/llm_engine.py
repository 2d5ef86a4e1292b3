"""The engine loop: requests in, one scheduled forward step at a time, finished requests out.

Lifecycle of a request: ``add_request`` (validated, WAITING) -> scheduled in steps (RUNNING, its
blocks allocated as its tokens are computed) -> finished by a stop condition or ``abort`` (its
blocks freed at once, or once the step in flight that may write them has run). ``num_used_blocks`` is
0 whenever no request is in flight.

With ``async_scheduling`` (in-process models; on GPUs by default) a decode step may be launched while the previous one's
tokens are still on the device (engine.overlap): ``finish_step`` then returns what the older step
finished, and a step can stay in flight between calls.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

import torch

from engine.config import ModelConfig
from engine.engine_config import EngineConfig
from engine.executor import Executor, LocalExecutor
from engine.model import DeepseekForCausalLM
from engine.model_runner import StepLogits
from engine.outputs import append_token, detokenize, record_prompt_logits
from engine.overlap import Feed, NextRows, advance, grow, next_decode_rows
from engine.parallel.expert_parallel import ExpertGroup, spans_dp
from engine.parallel.kv_layout import RankBlocks
from engine.prefix_cache import PrefixCache
from engine.sampler import PendingSamples, launch_sample
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduled, Scheduler
from engine.sequence import SeqStatus, Sequence
from engine.speculative import Drafts, SpecCounts, draft_budget, grammar_drafts
from engine.structured_output import Grammar, GuidanceTokenizers
from engine.tokenizer import Tokenizer


@dataclass
class _Launched:
    """A step handed to the executor and not yet finished."""

    id: int
    scheduled: list[Scheduled]
    logits: list[StepLogits | None] | None = None  # collected at launch (in-process executor)
    sampled: list[Sequence] | None = None  # the rows sampled, in order
    samples: PendingSamples | None = None  # their samples, on their way to the host
    advanced: bool = False  # its rows count as computed already: a step was launched on its samples
    ahead: bool = False  # launched by ``finish_step`` after the step before's drafts, for the next ``launch_step``
    starts: list[int] = field(default_factory=list)  # each request's first row's position, when launched


@dataclass(frozen=True)
class EngineLoad:
    """What a node publishes of one engine's state (``LLMEngine.load``)."""

    waiting: int  # queued requests (a decode node's admitted requests waiting to join count here)
    running: int
    queued_prefill_tokens: int  # prompt tokens of waiting and running requests not computed yet
    used_blocks: int
    free_blocks: int  # cached blocks (prefix caching) count as free: they are evicted when needed
    held: int  # finished requests whose KV is kept (``hold_kv``) until ``release``
    cached_blocks: int = 0  # prefix caching: blocks kept for a later prompt with the same prefix
    prefix_hit_blocks: int = 0  # prefix caching, since start: blocks found in the cache ...
    prefix_query_blocks: int = 0  # ... of those looked up
    preemptions: int = 0  # since start: running requests preempted for their blocks
    spec: SpecCounts | None = None  # speculative decoding's drafts since start (None: off)


@dataclass(frozen=True)
class HeldKV:
    """Where a held request's KV is: per (pcp, pp) rank its blocks (``kv_transfer``'s input), and how
    many logical blocks it has."""

    ranks: list[RankBlocks]
    num_blocks: int


def resolve_max_model_len(config: EngineConfig, mc: ModelConfig) -> int:
    n = config.max_model_len or mc.max_position_embeddings
    if n > mc.max_position_embeddings:
        raise ValueError(f"max_model_len {n} exceeds the model's max_position_embeddings {mc.max_position_embeddings}")
    return n


class LLMEngine:
    """Scheduling, sampling and request state for one model replica; ``executor`` runs the steps
    (default: the whole model in this process)."""

    def __init__(self, config: EngineConfig, executor: Executor | None = None, ep: ExpertGroup | None = None) -> None:
        """``ep``: this engine is one member of an EP group of in-process engines (``ExpertGroup``): it holds
        only its share of the routed experts and steps in lockstep with the others."""
        self.config = config
        self.model_config = ModelConfig.from_pretrained(config.model)
        mc = self.model_config
        self.max_model_len = resolve_max_model_len(config, mc)
        self.executor: Executor = (executor if executor is not None
                                   else LocalExecutor(config, mc, self.max_model_len, ep))
        self.prefix_cache = PrefixCache(self.executor.allocator) if config.enable_prefix_caching else None
        self.scheduler = Scheduler(
            self.prefix_cache or self.executor.allocator, config.block_size, config.max_num_batched_tokens,
            config.max_num_seqs, prefix=self.prefix_cache,
        )
        self.tokenizer = None if config.skip_tokenizer_init else Tokenizer(config.tokenizer or config.model)
        self._guidance = None if self.tokenizer is None else \
            GuidanceTokenizers(self.tokenizer, mc.vocab_size, mc.eos_token_ids)
        # Sampling runs on the driver's CPU unless the model is local on a GPU.
        self.device = getattr(self.executor, "device", torch.device("cpu"))
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self._requests: dict[str, Sequence] = {}
        self.held: dict[str, Sequence] = {}  # finished requests whose KV blocks are kept (hold_kv)
        self._ids = itertools.count()
        self._steps = itertools.count(1)
        self._launched: _Launched | None = None  # the oldest step in flight
        self._next: _Launched | None = None  # a step launched on its samples (overlap)
        self._done: list[Sequence] = []  # finished by a step completed inside launch_step
        # Sampling right after the launch (and overlapped decode steps) need the logits in this process.
        self._local = isinstance(self.executor, LocalExecutor)
        overlap = config.async_scheduling
        if overlap is None:  # on a GPU the launch returns at once; on a CPU the step runs inside it
            overlap = getattr(self.executor, "device", torch.device("cpu")).type == "cuda"
        # Speculative decoding (engine.speculative): its steps are not overlapped. On rank processes requests
        # that go on decoding draft too (across DP replicas in lockstep, EP: their drafts settled after all steps).
        self.speculative = config.speculative
        self.drafts: Drafts | None = None
        if self.speculative is not None:
            deferred = not self._local and spans_dp(config)
            self.drafts = Drafts(self.speculative, self.scheduler, self.executor, self.max_model_len, deferred=deferred)
        self.spec_counts = self.drafts.counts if self.drafts is not None else SpecCounts()
        self.overlap = self._local and overlap and self.speculative is None  # may change between steps
        self.overlapped_steps = 0  # steps launched on the previous step's samples, still on the device
        # Expert parallelism across DP replicas (engine.parallel.expert_parallel): while the node steps any
        # replica it steps every one, and a step with nothing scheduled still runs, without rows.
        self.lockstep = ep is not None
        # Speculative decoding's steps are launched ahead instead (``finish_step``): a step's next inputs are its
        # verified tokens and new drafts, known on the host only after both, so once they are the next step is
        # scheduled and launched, and runs while the caller takes the finished requests and delivers the step's
        # tokens (a decode node's events). Not in lockstep (EP), where every member launches together.
        self.spec_ahead = self._local and bool(overlap) and self.speculative is not None and not self.lockstep
        self.ahead_steps = 0  # steps launched that way

    @property
    def model(self) -> DeepseekForCausalLM:
        """The in-process model (local executor only)."""
        if not isinstance(self.executor, LocalExecutor):
            raise AttributeError("the model runs on rank processes, not in this process")
        return self.executor.model

    @property
    def cache_layers(self) -> dict[int, torch.Tensor]:
        """The in-process KV cache (local executor only): global layer index -> [num_blocks,
        block_size, L + R]; what a node registers with its KV transport."""
        cache = getattr(self.executor, "cache", None)
        if cache is None:
            raise AttributeError("the KV cache lives on rank processes, not in this process")
        return cache.layers

    # -- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        want_prompt_logits: bool = False,
        hold_kv: bool = False,
    ) -> Sequence:
        """Queue a request. ``hold_kv`` keeps its KV blocks after it finishes, until ``release``."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        text = prompt if isinstance(prompt, str) else None
        ids = self._tokenize(prompt)
        n = len(ids)
        if n == 0:
            raise ValueError("prompt is empty")
        if n > self.max_model_len:
            raise ValueError(f"prompt has {n} tokens, more than max_model_len {self.max_model_len}")
        bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.model_config.vocab_size}): {bad[:5]}")
        room = self.max_model_len - n
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._requests or request_id in self.held:
            raise ValueError(f"request id {request_id!r} is already in flight")
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=ids,
            params=params,
            max_tokens=max_tokens,
            eos_token_ids=self.model_config.eos_token_ids,
            prompt=text,
            generator=gen,
            want_prompt_logits=want_prompt_logits,
            hold_kv=hold_kv,
            cacheable=not want_prompt_logits and params.prompt_logprobs is None,  # a hit skips prompt rows
        )
        if params.structured_outputs is not None:
            if self._guidance is None:
                raise ValueError("structured output needs the tokenizer (the engine runs without one)")
            seq.grammar = Grammar(self._guidance.get(), params.structured_outputs)
        self._requests[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def begin_prefilled(self, prompt: list[int], params: SamplingParams, request_id: str | None = None) -> Sequence:
        """Admit a request whose prompt KV is computed elsewhere (disaggregated decode), first half:
        validate and allocate the prompt's blocks (``seq.block_ids``), which the KV transfer fills while
        the engine keeps stepping; ``admit_prefilled`` then queues it to join the running batch.

        With prefix caching, the prompt's leading blocks already cached here are shared and need no
        transfer: ``seq.block_ids[:seq.prefix_hit_blocks]``. The request is not scheduled until
        ``admit_prefilled``; ``abort`` frees its blocks. Raises ``MemoryError`` when the blocks are not
        free now.
        """
        seq = self.add_request(prompt, params, request_id)
        self.scheduler.waiting.remove(seq)
        # With prefix caching the leading blocks already cached here are shared, not transferred:
        # ``seq.block_ids[:seq.prefix_hit_blocks]`` hold them, the transfer fills the rest.
        seq.block_ids = self.scheduler.match_transferred(seq)
        first = len(seq.block_ids)  # logical position of the first new block (a sharded layout's owner)
        n = -(-len(prompt) // self.config.block_size) - first
        if not self.scheduler.allocator.can_allocate(n, first):
            self._requests.pop(seq.request_id, None)
            self.scheduler.finish(seq, "abort")
            raise MemoryError(f"no room for {n} KV blocks (free: {self.scheduler.allocator.num_free})")
        seq.block_ids += self.scheduler.allocator.allocate(n, first)
        return seq

    def admit_prefilled(
        self,
        seq: Sequence,
        table: list[int],
        first_token: int,
        first_logprob: float = float("nan"),
        first_top: dict[int, float] | None = None,
        drafts: list[int] | None = None,
    ) -> bool:
        """Second half of ``begin_prefilled``: the blocks hold the prompt's KV in the order ``table`` (the
        transfer may place the prompt's blocks among them as it likes: ``kv_transfer.planner.
        arrange_destination``); with ``first_token`` as
        its first output the request queues to join the running batch, which the scheduler lets it do
        within ``max_num_seqs`` (a decode node never runs more; the queued ones count as waiting).
        ``drafts`` (speculative decoding): the prefill node's drafts of the tokens after ``first_token``,
        verified at its first step; the MTP layer's KV of the prompt came with the rest. None: that KV is
        not here. Then, where ``recomputes_mtp_kv(seq)``, the prompt and ``first_token`` are computed again here
        as a preempted request's are (from its cached prefix blocks on: the rest of its blocks need hold no
        KV), the MTP layer running over them as over any prompt, and the request drafts from the step after;
        otherwise it decodes without drafts. Returns True if ``first_token`` already finished it."""
        if self._requests.get(seq.request_id) is not seq:
            raise KeyError(f"request {seq.request_id!r} is not waiting for admission (aborted?)")
        if sorted(table) != sorted(seq.block_ids):
            raise ValueError("the block table must be made of exactly the blocks allocated for the request")
        hit = seq.prefix_hit_blocks
        if table[:hit] != seq.block_ids[:hit]:
            raise ValueError(f"the block table must keep the {hit} cached prefix blocks first, in order")
        if not 0 <= first_token < self.model_config.vocab_size:
            raise ValueError(f"first token {first_token} outside the vocabulary")
        if any(not 0 <= t < self.model_config.vocab_size for t in drafts or ()):
            raise ValueError("a draft token is outside the vocabulary")
        if seq.grammar is not None and not seq.grammar.allows(first_token):
            raise ValueError(f"first token {first_token} is not allowed by the request's structured output")
        seq.block_ids = list(table)
        recompute = drafts is None and self.recomputes_mtp_kv(seq)
        # Recomputed: from its cached prefix (whose MTP layer's KV is there: only requests with it share blocks).
        seq.num_computed = seq.prefix_hit_blocks * self.config.block_size if recompute else len(seq.prompt_token_ids)
        seq.mtp_kv = drafts is not None or recompute
        if self.speculative is not None and not seq.mtp_kv:
            seq.cacheable = False  # its blocks lack the MTP layer's KV: no later prompt may share them
        self.scheduler.cache_computed(seq)  # its full prompt blocks now hold KV: later requests may share them
        seq.status = SeqStatus.WAITING
        self.scheduler.waiting.append(seq)
        top = first_top if seq.params.logprobs is not None else None
        if self._append(seq, first_token, first_logprob, top):  # max_tokens=1, or a stop token
            self._requests.pop(seq.request_id, None)
            return True
        if self.drafts is not None and drafts:
            seq.drafts = grammar_drafts(seq, list(drafts[: draft_budget(seq, self.drafts.k, self.max_model_len)]))
        return False

    def recomputes_mtp_kv(self, seq: Sequence) -> bool:
        """Whether ``seq``, admitted without the MTP layer's KV of its prompt (``admit_prefilled`` without
        drafts), computes its prompt again here to draft: speculative decoding in process with
        ``mtp_recompute`` (every request drafts, penalised ones and those with a ``min_tokens`` too)."""
        return self.speculative is not None and self._local and self.config.mtp_recompute

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (skip_tokenizer_init is set): pass token ids")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) for t in prompt):
            raise TypeError("a prompt must be a string or a list of token ids (ints)")
        return list(prompt)

    def abort(self, request_id: str) -> bool:
        """Stop a request (or release a held one); its blocks are free on return, or once the step in
        flight that may still write them has run (``async_scheduling``)."""
        if self.release(request_id):
            return True
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq, "abort")
        return True

    def release(self, request_id: str) -> bool:
        """Free the KV blocks of a finished request that was held (``hold_kv``)."""
        seq = self.held.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.free(seq.block_ids)
        seq.block_ids = []
        return True

    def _lookup(self, request_id: str) -> Sequence:
        seq = self._requests.get(request_id) or self.held.get(request_id)
        if seq is None:
            raise KeyError(f"no request {request_id!r} in flight or held")
        return seq

    def kv_ownership(self, request_id: str) -> list[RankBlocks]:
        """Which (pcp, pp) rank holds which of the request's blocks, for which layers."""
        return self.executor.ownership(self._lookup(request_id).block_ids)

    @property
    def mtp_layers(self) -> frozenset[int]:
        """The cache layers of the model's multi-token prediction layers (speculative decoding's): a KV
        transfer moves them when both sides hold them (``kv_transfer.planner``)."""
        n = self.model_config.num_hidden_layers
        return frozenset(range(n, n + self.model_config.num_nextn_predict_layers))

    def held_kv(self, request_id: str) -> HeldKV:
        """Where a request's KV is (one held after it finished, ``hold_kv``, or one in flight)."""
        seq = self._lookup(request_id)
        return HeldKV(self.executor.ownership(seq.block_ids), len(seq.block_ids))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._launched is not None

    @property
    def num_used_blocks(self) -> int:
        return self.scheduler.allocator.num_used

    def load(self) -> EngineLoad:
        """The queues, blocks and prefix cache counters, for the load a node publishes."""
        s, c = self.scheduler, self.prefix_cache
        queued = sum(max(len(q.prompt_token_ids) - q.num_computed, 0) for q in list(s.waiting) + list(s.running))
        counts = {} if c is None else {"cached_blocks": c.num_cached, "prefix_hit_blocks": c.hits,
                                       "prefix_query_blocks": c.queries}
        return EngineLoad(waiting=len(s.waiting), running=len(s.running), queued_prefill_tokens=queued,
                          used_blocks=self.num_used_blocks, free_blocks=s.allocator.num_free, held=len(self.held),
                          preemptions=s.preemptions,
                          spec=None if self.speculative is None else dataclasses.replace(self.spec_counts), **counts)

    def take_kv_events(self) -> tuple[list[int], list[int]]:
        """Block hashes that joined and left the prefix cache since the last call (none when it is off)."""
        return self.prefix_cache.take_events() if self.prefix_cache is not None else ([], [])

    def shutdown(self) -> None:
        self.executor.shutdown()

    # -- the loop ------------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Run one forward step. Returns the requests that finished (with ``async_scheduling``: in the
        step before it, whose tokens reach the host while this one runs)."""
        self.launch_step()
        return self.finish_step()

    def launch_step(self) -> int:
        """Schedule a step and hand it to the executor (returns before it has run on rank processes).

        With a decode step left in flight by ``finish_step`` (``async_scheduling``), the next one is
        launched on its samples if it can be (``_launch_overlapped``); otherwise that step is finished
        first and the next is scheduled from the host's state (``_launch_scheduled``). Returns how many
        requests it scheduled: 0 when all that is left waits for blocks held elsewhere (see
        ``_blocks_held_elsewhere``)."""
        assert self._next is None, "launch_step() twice without finish_step()"
        self.settle_drafts()  # (a caller that did not: its ranks' answers come before the next step's)
        prev = self._launched
        if prev is not None and prev.ahead:  # already launched, by the last finish_step
            prev.ahead = False
            return len(prev.scheduled)
        if prev is not None:
            launched = self._launch_overlapped(prev)
            if launched:
                return launched
            self._launched = None  # (first: a failure below must not leave it looking in flight)
            self._done += self._complete(prev, None)
        return self._launch_scheduled()

    def _launch_scheduled(self) -> int:
        """A step as the scheduler picks it, every request's tokens on the host."""
        scheduled = self.scheduler.schedule()
        if not scheduled and self.scheduler.has_unfinished() and not self._blocks_held_elsewhere():
            raise RuntimeError("scheduler made no progress (KV cache too small for any waiting request)")
        if scheduled or self.lockstep:  # lockstep: a step without rows, for the EP group's collectives
            self._launched = self._launch(scheduled)
        return len(scheduled)

    def _launch_overlapped(self, prev: _Launched) -> int:
        """The next decode step launched on ``prev``'s samples, still on the device (``engine.overlap``);
        0 when it cannot follow ``prev`` that way."""
        rows = self._next_rows(prev)
        if rows is None:
            return 0
        assert prev.samples is not None and prev.sampled is not None
        advance(prev.scheduled)
        prev.advanced = True
        step = grow(self.scheduler, rows)
        where = {id(q): i for i, q in enumerate(prev.sampled)}
        fed = len(rows.follow)  # the first rows; the joining requests' tokens are on the host
        feed = Feed(prev.samples.tokens, list(range(fed)), [where[id(s.seq)] for s in step[:fed]])
        try:
            self._next = self._launch(step, feed)
        except BaseException:
            # Its requests are past a step whose samples are lost: the caller aborts them (LLM, nodes);
            # the older step must not be advanced again.
            self._launched = None
            raise
        self.overlapped_steps += 1
        return len(step)

    def _next_rows(self, step: _Launched) -> NextRows | None:
        """The rows a decode step can run on ``step``'s samples (None: it cannot be overlapped)."""
        if not self.overlap or step.samples is None:
            return None
        return next_decode_rows(self.scheduler, step.scheduled)

    def _launch(self, scheduled: list[Scheduled], feed: Feed | None = None) -> _Launched:
        step = _Launched(next(self._steps), scheduled, starts=[s.seq.num_computed for s in scheduled])
        if feed is not None:
            assert isinstance(self.executor, LocalExecutor)
            self.executor.launch(scheduled, feed)
        else:
            self.executor.launch(scheduled)
        if self._local:  # in process the logits are here now: sampling is queued behind the step
            step.logits = self.executor.collect()
            self._queue_samples(step, step.logits)
        if self.overlap or self.speculative is not None:
            # Blocks freed from now on wait for this step (speculative decoding: for its MTP pass too, which
            # writes every row of the step after the tokens are taken).
            self.scheduler.free_after = step.id
        return step

    def _queue_samples(self, step: _Launched, logits: list[StepLogits | None]) -> None:
        """Queue the sampling of the step's rows that reach the end of their request's tokens."""
        seqs, rows = [], []
        for s, sl in zip(step.scheduled, logits):
            if s.samples and not s.seq.is_finished and not s.drafts:  # drafts: verified in _complete
                assert sl is not None
                seqs.append(s.seq)
                rows.append(sl.logits[-1])
        step.sampled = seqs
        if rows:
            step.samples = launch_sample(torch.stack(rows), seqs, self.generator)

    def _blocks_held_elsewhere(self) -> bool:
        """Blocks the scheduler cannot preempt: held finished requests (``hold_kv``) and requests
        being filled by a transfer (``begin_prefilled``). They will be freed by their owner, so a
        step with nothing to schedule waits for them instead of failing."""
        if self.held:
            return True
        queued = {id(s) for s in self.scheduler.waiting} | {id(s) for s in self.scheduler.running}
        return any(id(s) not in queued and s.block_ids for s in self._requests.values())

    def finish_step(self) -> list[Sequence]:
        """Wait for a launched step, sample, and return the requests that finished in it.

        With ``async_scheduling``, when a step was launched on the oldest one's samples, the oldest is
        finished and the newer one stays in flight; a decode step that a next one can follow is left
        in flight for ``launch_step`` to do that."""
        finished, self._done = self._done, []
        step = self._launched
        if step is None:
            return finished
        if self._next is None and self._next_rows(step) is not None:
            return finished  # the next launch_step runs on its samples, then this finishes
        newer, self._launched, self._next = self._next, self._next, None
        ahead = self.spec_ahead and newer is None
        finished += self._complete(step, newer, ahead)
        if ahead:
            self._done = finished  # (should the launch fail, the next finish_step still returns them)
            try:
                self._launch_ahead()
            finally:
                self._land(step)
            self._done = []
        return finished

    def _launch_ahead(self) -> None:
        """Speculative decoding: the next step scheduled and launched now, right after the last one's drafts
        (``spec_ahead``), which may still be on the device: its verify rows then read them there (``Drafts.feed``).
        Requests that arrive before the caller's next ``launch_step`` join the step after."""
        scheduled = self.scheduler.schedule()
        if scheduled:  # nothing: the next launch_step schedules as ever (and says why none can run)
            assert self.drafts is not None
            self._launched = self._launch(scheduled, self.drafts.feed(scheduled))
            self._launched.ahead = True
            self.ahead_steps += 1

    def _land(self, step: _Launched) -> None:
        """After ``_launch_ahead``: ``step``'s drafts, if still on the device, reach the host (and the step just
        launched, its verify rows' tokens); then the blocks freed when ``step`` completed are given back (its MTP
        passes wrote the rows of every request in it, those that finished too)."""
        assert self.drafts is not None
        if not self.drafts.in_flight:
            return
        self.drafts.land(self._launched.scheduled if self._launched is not None else [])
        self.scheduler.release_deferred(step.id)
        if self._launched is None:
            self.scheduler.free_after = None

    def _complete(self, step: _Launched, newer: _Launched | None, ahead: bool = False) -> list[Sequence]:
        """Wait for ``step``'s samples and apply them: tokens appended, stops checked, blocks cached
        (blocks freed meanwhile wait for ``newer``, the step still in flight, if any). ``ahead``: the next step
        is launched before the drafts are taken (``finish_step``), so they may stay on the device (and the
        blocks freed here with them, until ``_land``)."""
        self.scheduler.free_after = newer.id if newer is not None else (
            step.id if self.speculative is not None else None)
        logits = step.logits if step.logits is not None else self.executor.collect()
        if step.samples is None and step.sampled is None:  # before the rows count as computed: that decides
            self._queue_samples(step, logits)  # which rows sample
        finished: list[Sequence] = []
        for s, sl in zip(step.scheduled, logits):
            if s.seq.is_finished:
                continue  # aborted while the step ran: its blocks are already free (or will be)
            if not step.advanced:
                record_prompt_logits(s, sl)
                s.seq.num_computed += s.num_new - len(s.drafts)  # a draft's row counts once it is accepted
            self.scheduler.cache_computed(s.seq)
        seqs = step.sampled or []
        samples = step.samples.result() if step.samples is not None else []
        for seq, smp in zip(seqs, samples):
            if step.advanced and seq.pending:
                seq.pending -= 1
            if seq.is_finished:
                continue  # a row run on a pending token of a request that its previous step ended
            if self._append(seq, smp.token, smp.logprob, smp.top):
                finished.append(seq)
        if self.speculative is not None:
            finished += self._verify(step.scheduled, logits)
            self._draft(step, ahead)
        for seq in finished:
            self._requests.pop(seq.request_id, None)
            if seq.hold_kv and seq.block_ids:
                self.held[seq.request_id] = seq
        if self.drafts is not None and self.drafts.in_flight:
            return finished  # the blocks freed here wait for the drafts (``_land``)
        self.scheduler.release_deferred(step.id)
        if self.speculative is not None and newer is None:
            self.scheduler.free_after = None
        return finished

    def _verify(self, scheduled: list[Scheduled], logits: list[StepLogits | None]) -> list[Sequence]:
        """Speculative decoding: the step's drafts verified and the tokens appended; the requests that finished."""
        assert self.drafts is not None
        with torch.profiler.record_function("spec.verify"):  # named in profiles (benchmarks/mtp_verify.py)
            return self.drafts.verify(scheduled, logits, self.generator, self._append)

    def _draft(self, step: _Launched, ahead: bool = False) -> None:
        """Speculative decoding: the MTP layer over the step's rows, and the next drafts (``ahead``: they may stay
        on the device, ``Drafts.draft``). In lockstep (EP) a step without rows here still runs the layer's MoE
        collectives for the other members' rows."""
        assert self.drafts is not None
        with torch.profiler.record_function("spec.draft"):
            if step.scheduled or not self.lockstep:
                self.drafts.draft(step.scheduled, step.starts, ahead)
            else:
                self.drafts.idle()

    def settle_drafts(self) -> None:
        """Speculative decoding on rank processes whose DP replicas step in lockstep (expert parallelism across
        them): the drafts of the step just finished, asked for by ``finish_step`` and taken here. Their MTP pass
        dispatches over every replica's ranks, so the caller finishes every replica's step before it settles any
        (``LLM``, the prefill node's worker); the held requests' drafts are then set. Elsewhere a no-op."""
        if self.drafts is not None:
            self.drafts.settle()

    def _append(self, seq: Sequence, token: int, logprob: float, top: dict[int, float] | None) -> bool:
        """Add a sampled token (``engine.outputs.append_token``); returns True when the request finished (its
        blocks are then free, or held for ``release``)."""
        reason = append_token(seq, token, logprob, top, self.tokenizer)
        if reason is None:
            return False
        self.scheduler.finish(seq, reason, keep_blocks=seq.hold_kv)
        return True

    def detokenize(self, seq: Sequence) -> str:
        return detokenize(seq, self.tokenizer)


__all__ = ["EngineLoad", "HeldKV", "LLMEngine", "SeqStatus"]

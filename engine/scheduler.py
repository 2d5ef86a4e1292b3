"""Continuous batching with a per-step token budget and chunked prefill.

Each step: running requests first (decodes, then unfinished prefills), then waiting requests in
arrival order while the token budget (``max_num_batched_tokens``) and ``max_num_seqs`` allow. A
prompt longer than the remaining budget is prefilled in chunks over several steps. When KV blocks
run out, the most recently admitted running request is preempted: its blocks are freed and it is
recomputed later (vLLM's recompute preemption). With prefix caching (``engine.prefix_cache``) a
request starts after the longest prefix of full blocks already cached, and the blocks a step
completes join the cache.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.block_hash import block_hash
from engine.kv_cache import BlockSpace
from engine.prefix_cache import PrefixCache
from engine.sequence import SeqStatus, Sequence


@dataclass
class Scheduled:
    seq: Sequence
    num_new: int
    drafts: list[int] = field(default_factory=list)  # the last num_new - 1 rows' tokens: drafts to verify

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the request's tokens (so it samples one)."""
        return self.seq.num_computed + self.num_new - len(self.drafts) == self.seq.num_tokens


class Scheduler:
    def __init__(
        self, allocator: BlockSpace, block_size: int, max_num_batched_tokens: int, max_num_seqs: int,
        prefix: PrefixCache | None = None,
    ) -> None:
        """``prefix``: the allocator as a ``PrefixCache`` when prefix caching is on (``allocator`` is it)."""
        self.allocator = allocator
        self.prefix = prefix
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0  # since start, for the node's metrics
        # Speculative decoding: the MTP layer's KV at a block's last position depends on the next block's first
        # token, which a prefix hash does not cover: a prompt recomputes (or pulls) the last block it matched.
        self.spare_blocks = 0
        # Blocks freed while a launched step may still write them wait for that step (engine.overlap):
        # ``free_after`` is the newest step in flight (None: none), ``_deferred`` its frees.
        self.free_after: int | None = None
        self._deferred: list[tuple[int, list[int]]] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def free(self, blocks: list[int]) -> None:
        """Give blocks back: now, or when the step in flight that may write them has run."""
        if self.free_after is None:
            self.allocator.free(blocks)
        elif blocks:
            self._deferred.append((self.free_after, list(blocks)))

    def release_deferred(self, done: int) -> None:
        """Step ``done`` has run: the blocks freed while it (or an earlier step) was the newest in flight."""
        keep = []
        for step, blocks in self._deferred:
            if step <= done:
                self.allocator.free(blocks)
            else:
                keep.append((step, blocks))
        self._deferred = keep

    @property
    def num_deferred(self) -> int:
        return sum(len(b) for _, b in self._deferred)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def blocks_to_add(self, seq: Sequence, num_new: int) -> int:
        """Blocks ``seq`` lacks for its next ``num_new`` rows."""
        need = -(-(seq.num_computed + num_new) // self.block_size)
        return max(0, need - len(seq.block_ids))

    def grow(self, seq: Sequence, num_new: int) -> bool:
        """Allocate the blocks ``seq`` lacks for its next ``num_new`` rows; False if they are not free."""
        n = self.blocks_to_add(seq, num_new)
        first = len(seq.block_ids)
        if not self.allocator.can_allocate(n, first):
            return False
        seq.block_ids.extend(self.allocator.allocate(n, first))
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.preemptions += 1
        seq.drafts = []
        self.free(seq.block_ids)
        seq.block_ids = []
        seq.num_computed = 0
        seq.num_registered = 0
        seq.status = SeqStatus.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def schedule(self) -> list[Scheduled]:
        budget = self.max_num_batched_tokens
        out: list[Scheduled] = []
        # Decodes (one token left) first, then requests part-way through their prompt.
        order = sorted(self.running, key=lambda s: s.num_remaining != 1)
        scheduled: set[str] = set()
        for seq in order:
            if budget == 0:
                break
            if seq.status != SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_remaining, budget)
            drafts = seq.drafts[: budget - 1] if seq.num_remaining == 1 else []
            if drafts and self.grow(seq, 1 + len(drafts)):
                n = 1 + len(drafts)  # the last token and the drafts to verify (engine.speculative)
            else:
                drafts = []
            while not self.grow(seq, n):
                # Preempt the most recently admitted request not already in this step.
                victim = next(
                    (s for s in reversed(self.running) if s is not seq and s.request_id not in scheduled), None
                )
                if victim is None:
                    self._preempt(seq)
                    break
                self._preempt(victim)
            if seq.status != SeqStatus.RUNNING:
                continue
            out.append(Scheduled(seq, n, drafts))
            scheduled.add(seq.request_id)
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hit = self._match_prefix(seq)
            n = min(seq.num_remaining, budget)
            # A transferred request joins with the prefill node's drafts (engine.speculative): verified now.
            drafts = seq.drafts[: budget - 1] if seq.num_remaining == 1 else []
            if drafts and self.grow(seq, 1 + len(drafts)):
                n = 1 + len(drafts)
            else:
                drafts = []
            if not self.grow(seq, n):
                if hit:  # give the shared blocks back: the request starts over when there is room
                    self.free(seq.block_ids)
                    seq.block_ids, seq.num_computed, seq.num_registered, seq.prefix_hit_blocks = [], 0, 0, 0
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.append(Scheduled(seq, n, drafts))
            budget -= n
        # Decode rows first, then verify steps' rows (in process decode rows too: the model attends them in one
        # batched absorbed pass), then prompts' chunks. On rank processes a verify step's rows are a chunk, and a
        # step plan has its single rows first (engine.parallel.step_plan).
        out.sort(key=lambda s: 0 if s.num_new == 1 else 1 if s.drafts else 2)
        return out

    # -- prefix caching -----------------------------------------------------------------------
    def _hashes(self, seq: Sequence, n: int) -> list[int]:
        """The hashes of ``seq``'s first ``n`` full blocks (computed once, kept on the request)."""
        hashes = seq.block_hashes
        bs = self.block_size
        for j in range(len(hashes), n):
            hashes.append(block_hash(hashes[j - 1] if j else None, seq.tokens(j * bs, (j + 1) * bs)))
        return hashes[:n]

    def _match_prefix(self, seq: Sequence) -> int:
        """A request about to start: take the cached blocks of its longest cached prefix (leaving at
        least its last token to compute, whose logits sample the next one). Returns the blocks hit."""
        if self.prefix is None or not seq.cacheable or seq.num_computed or seq.block_ids:
            return 0
        ids = self.prefix.match(self._hashes(seq, (seq.num_tokens - 1) // self.block_size), self.spare_blocks)
        seq.block_ids = ids
        seq.num_registered = seq.prefix_hit_blocks = len(ids)
        seq.num_computed = len(ids) * self.block_size
        return len(ids)

    def match_transferred(self, seq: Sequence) -> list[int]:
        """A request whose prompt KV arrives by transfer: the cached blocks of its longest cached prefix
        of full prompt blocks (referenced for it; the transfer need not bring them). Its last token
        was computed elsewhere, so every full block may hit."""
        if self.prefix is None or not seq.cacheable:
            return []
        ids = self.prefix.match(self._hashes(seq, len(seq.prompt_token_ids) // self.block_size), self.spare_blocks)
        seq.num_registered = seq.prefix_hit_blocks = len(ids)
        return ids

    def cache_computed(self, seq: Sequence) -> None:
        """After a step: the request's blocks whose tokens are now all computed join the cache."""
        if self.prefix is None or not seq.cacheable:
            return
        full = min(seq.num_computed // self.block_size, len(seq.block_ids))
        if full <= seq.num_registered:
            return
        hashes = self._hashes(seq, full)
        for j in range(seq.num_registered, full):
            self.prefix.register(seq.block_ids[j], hashes[j])
        seq.num_registered = full

    def finish(self, seq: Sequence, reason: str, keep_blocks: bool = False) -> None:
        """Mark a request finished (from running or waiting) and release its blocks unless kept."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.block_ids and not keep_blocks:
            self.free(seq.block_ids)
            seq.block_ids = []
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

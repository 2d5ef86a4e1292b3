"""Overlapped decode steps: the next decode step is launched before the host has the current one's tokens.

A decode step's host work (sampling's wait, appending tokens and checking stops, scheduling, building the
next step's inputs, and on a decode node the token events) otherwise leaves the GPU idle between steps.
With a decode step N in flight, its requests' next step N+1 can be launched at once: each row's input
token is N's sampled token, still on the device (``Feed``), and its position and block are known on
the host. The host then waits for N's tokens while N+1 runs, and appends them.

What this costs and what it rules out:
- A request that N ends with a stop token has already been given a row in N+1; that row's output is
  dropped (a request that N ends by length is left out of N+1: that is known in advance).
- Blocks freed while a step is in flight are given back only after it has run (``Scheduler.free``), so
  a KV transfer never lands in a block the GPU may still write.
- All or none: a batch is overlapped only if every request that goes on can take part, that is nothing
  in its sampling needs its newest token on the host (no grammar: structured output masks the next token
  from the last; no penalties: they count the output so far), and its KV is not kept after it ends
  (``hold_kv``: a dropped row would still write its last block). Leaving one out would give it a token
  only every other step.
- Only when the whole running batch is one decode step, and whoever waits is a decode node's admitted
  request (its prompt's KV pulled, its first token on the host: it joins the next step). Prefills and
  preemption take the ordinary path, one step at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.scheduler import Scheduled, Scheduler
from engine.sequence import SeqStatus, Sequence


@dataclass
class Feed:
    """Input tokens still on the device: row ``rows[i]`` of the step takes ``tokens[src[i]]``."""

    tokens: torch.Tensor  # [N] long, a previous step's samples
    rows: list[int]
    src: list[int]

    def apply(self, input_ids: torch.Tensor) -> None:
        """Write the fed tokens into a step's ``input_ids`` (on its device, no wait for the host)."""
        idx = torch.tensor([self.rows, self.src], dtype=torch.long).to(input_ids.device, non_blocking=True)
        input_ids.index_copy_(0, idx[0], self.tokens.index_select(0, idx[1]))


def goes_on(seq: Sequence) -> bool:
    """Whether the request goes on after the step in flight (whose token is its last when that reaches
    ``max_tokens``)."""
    return len(seq.output_token_ids) + seq.pending + 1 < seq.max_tokens


def can_follow(seq: Sequence) -> bool:
    """Whether the request's next token may be sampled before its newest one reaches the host."""
    p = seq.params
    return (seq.grammar is None and not seq.hold_kv and p.presence_penalty == 0 and p.frequency_penalty == 0
            and p.repetition_penalty == 1)


def decode_ready(seq: Sequence) -> bool:
    """A waiting request whose next row is a decode row with its token on the host: its prompt's KV is
    in place (pulled from a prefill node) and its first token appended."""
    return seq.num_computed > 0 and seq.pending == 0 and seq.num_remaining == 1


@dataclass
class NextRows:
    """The next decode step's requests: ``follow`` run on the step in flight's samples (fed), ``join``
    come from the waiting queue with their token on the host."""

    follow: list[Sequence]
    join: list[Sequence]


def next_decode_rows(scheduler: Scheduler, step: list[Scheduled]) -> NextRows | None:
    """The requests of decode step ``step`` (in flight, its tokens not yet on the host) that the next
    decode step can run now, and the waiting requests that can join it (as many as there is room for),
    or None when it cannot be launched that way: the step is not all decode rows of every running
    request, a request that goes on needs its newest token on the host, a waiting request needs a
    prefill, nobody goes on, or the blocks are not free."""
    seqs = [s.seq for s in step if not s.seq.is_finished]
    # decode rows only: each samples, past its prompt (a prompt's last row may want prompt logprobs)
    if not step or any(s.num_new != 1 or not s.samples or q.num_computed < len(q.prompt_token_ids)
                       for s, q in ((s, s.seq) for s in step if not s.seq.is_finished)):
        return None
    if len(seqs) != len(scheduler.running) or {id(q) for q in seqs} != {id(q) for q in scheduler.running}:
        return None
    follow = [q for q in seqs if goes_on(q)]
    # All or none: a request left out would get its tokens only every other step (the step after a fed
    # one runs one step at a time, to take it back in).
    if not follow or not all(can_follow(q) for q in follow):
        return None
    if not all(decode_ready(q) for q in scheduler.waiting):
        return None
    room = min(scheduler.max_num_seqs, scheduler.max_num_batched_tokens) - len(seqs)
    join = list(scheduler.waiting)[: max(room, 0)]  # in arrival order; the rest join a later step
    # followers: a row past the one in flight; joiners: their first row
    need = sum(scheduler.blocks_to_add(q, 2) for q in follow) + sum(scheduler.blocks_to_add(q, 1) for q in join)
    if need and not scheduler.allocator.can_allocate(need, 0):
        return None
    return NextRows(follow, join)


def advance(step: list[Scheduled]) -> None:
    """The step's rows count as computed and its samples as pending: the next step runs past them."""
    for s in step:
        if not s.seq.is_finished:
            s.seq.num_computed += s.num_new
            s.seq.pending += 1


def grow(scheduler: Scheduler, rows: NextRows) -> list[Scheduled]:
    """Each request's row of the next step (its block for the new position allocated); the joining
    requests leave the waiting queue for the running batch."""
    for q in rows.join:
        scheduler.waiting.remove(q)
        q.status = SeqStatus.RUNNING
        scheduler.running.append(q)
    out = []
    for q in rows.follow + rows.join:
        if not scheduler.grow(q, 1):  # next_decode_rows found them free
            raise MemoryError(f"no free KV block for request {q.request_id}'s next row")
        out.append(Scheduled(q, 1))
    return out

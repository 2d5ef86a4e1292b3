"""The prefill node's engine side: DP replicas of PCP x PP ranks, stepped on one thread.

Request lifecycle here:

1. ``submit`` queues a prefill (from the gRPC handler's event loop); the engine thread adds it to
   its replica with ``hold_kv`` and a one-token budget, and steps every busy replica together
   (launch all, then collect: replicas compute concurrently).
2. When the first token is sampled the request finishes with its KV blocks kept. If that token
   ends the request (a stop token, or ``max_tokens`` 1) the blocks are freed at once; otherwise
   they are held under a lease and the answer carries the KV handle: which rank holds which block
   and where each rank's registered cache is.
3. ``release`` (the decode side has the KV), ``abort``, or the lease running out frees them.

Every engine call happens on the engine thread; other threads talk to it through the inbox.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cluster.config import NodeConfig
from cluster.nodes import ReplicaLoad
from cluster.proto_gen import pdcluster_v1_pb2 as pb
from cluster.wire import token_pb
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from kv_transfer.handle import to_handle
from kv_transfer.layout import CacheLayout, describe_cache
from kv_transfer.lease import LeaseTable

log = logging.getLogger("pdcluster.prefill")


class Aborted(Exception):
    """The request was aborted before its prefill finished."""


class NodeFailed(Exception):
    """The engine cannot serve (a rank died, or the node is stopping)."""


@dataclass
class PrefillJob:
    request_id: str
    token_ids: list[int]
    params: SamplingParams  # the user's; the engine runs it with max_tokens=1
    dp_rank: int  # -1: least loaded
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    arrived: float = dataclasses.field(default_factory=time.monotonic)
    started: float | None = None
    seq: Sequence | None = None
    replica: int = -1

    def resolve(self, result: Any = None, error: BaseException | None = None) -> None:
        def set_() -> None:
            if self.future.done():
                return
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(result)

        self.loop.call_soon_threadsafe(set_)


class PrefillWorker:
    def __init__(self, config: NodeConfig, transfer_host: str) -> None:
        self.config = config
        ec = config.engine
        par = ec.parallel()
        self.layouts: dict[int, CacheLayout]
        self._transport = None
        if par.world_size > 1:
            # The ranks register their caches with Mooncake themselves, on the advertised host.
            self.llm = LLM.from_config(dataclasses.replace(ec, kv_transport="mooncake", dist_host=transfer_host))
            assert self.llm.node is not None
            self.layouts = dict(self.llm.node.cache_layouts)
        else:
            from kv_transfer.transports.mooncake import MooncakeTransport

            self.llm = LLM.from_config(ec)
            self._transport = MooncakeTransport(host=transfer_host)
            layout = describe_cache(self._transport.endpoint, self.llm.engine.executor.cache.layers)
            self._transport.register(layout)
            self.layouts = {0: layout}
        self.engines: list[LLMEngine] = self.llm.engines
        self.max_model_len = self.engines[0].max_model_len
        self.num_blocks = self.engines[0].scheduler.allocator.num_free
        self.block_size = ec.block_size
        self.address = ""  # set once the server listens (goes into KV handles)
        self.leases = LeaseTable(self._release_held, lease_s=config.lease_s)
        self.held_on: dict[str, int] = {}  # request id -> replica holding its blocks
        self.jobs: dict[str, PrefillJob] = {}  # submitted, not answered
        self.failed = threading.Event()
        self.failure: str | None = None
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._load = [ReplicaLoad(dp_rank=d, free_blocks=self.num_blocks) for d in range(len(self.engines))]
        # Answers wait here until the load they changed is published, so a Stats call made after an
        # answer always sees its effect.
        self._answers: list[Callable[[], None]] = []
        self._thread = threading.Thread(target=self._run, name="prefill-engine", daemon=True)
        self._thread.start()

    # -- called from other threads -------------------------------------------------------------
    def submit(self, job: PrefillJob) -> None:
        self._send("prefill", job)

    def abort(self, request_id: str, done: Callable[[bool], None] | None = None) -> None:
        """Free whatever the request holds (queued, prefilling, or held under a lease); ``done(found)``
        is called from the engine thread once it is free."""
        self._send("abort", (request_id, done))

    def release(self, request_id: str, done: Callable[[bool], None]) -> None:
        self._send("release", (request_id, done))

    def load(self) -> list[ReplicaLoad]:
        return list(self._load)

    def in_flight(self) -> int:
        return len(self.jobs) + len(self.leases)

    def abort_all(self, why: str) -> None:
        self._send("abort_all", why)

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)
        self.llm.shutdown()
        if self._transport is not None:
            self._transport.close()

    def stats(self) -> tuple[list[pb.ReplicaStats], pb.TransferTotals]:
        reps = [pb.ReplicaStats(dp_rank=r.dp_rank, waiting=r.waiting, running=r.running,
                                queued_prefill_tokens=r.queued_prefill_tokens, used_blocks=r.used_blocks,
                                free_blocks=r.free_blocks, held=self._held_count(r.dp_rank)) for r in self._load]
        return reps, pb.TransferTotals(leases_expired=self.leases.expired_total)

    def _held_count(self, d: int) -> int:
        return sum(1 for v in list(self.held_on.values()) if v == d)

    def _send(self, kind: str, arg: Any) -> None:
        self._inbox.put((kind, arg))
        self._wake.set()

    # -- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop:
                self._handle_inbox()
                self.leases.expire()
                busy = [(d, e) for d, e in enumerate(self.engines) if e.has_unfinished()]
                scheduled = 0
                if busy:
                    for _, e in busy:
                        scheduled += e.launch_step()
                    for d, e in busy:
                        for seq in e.finish_step():
                            self._finished(d, seq)
                self._publish_load()
                answers, self._answers = self._answers, []
                for answer in answers:
                    answer()
                if not scheduled:  # idle, or waiting for held blocks to be released
                    self._wake.wait(0.05)
                    self._wake.clear()
        except BaseException as e:  # a rank died or the engine broke: nothing more can be served
            log.exception("prefill engine failed")
            self.failure = f"{type(e).__name__}: {e}"
            self.failed.set()
            for job in list(self.jobs.values()):
                job.resolve(error=NodeFailed(self.failure))
            self.jobs.clear()

    def _handle_inbox(self) -> None:
        while True:
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "prefill":
                self._start(arg)
            elif kind == "abort":
                rid, done = arg
                found = self._abort(rid)
                if done is not None:
                    self._answers.append(lambda done=done, found=found: done(found))
            elif kind == "release":
                rid, done = arg
                found = self.leases.confirm(rid)
                self._answers.append(lambda done=done, found=found: done(found))
            elif kind == "abort_all":
                for rid in list(self.jobs) + list(self.held_on):
                    self._abort(rid, NodeFailed(f"aborted: {arg}"))

    def _start(self, job: PrefillJob) -> None:
        if self._stop or self.failed.is_set():
            job.resolve(error=NodeFailed("the node is stopping"))
            return
        if job.request_id in self.jobs or job.request_id in self.held_on:
            job.resolve(error=ValueError(f"request id {job.request_id!r} is already in flight"))
            return
        d = job.dp_rank if job.dp_rank >= 0 else min(range(len(self._load)), key=self._cost)
        try:
            if len(job.token_ids) >= self.max_model_len:
                raise ValueError(f"prompt has {len(job.token_ids)} tokens: no room for output within "
                                 f"max_model_len {self.max_model_len}")
            # One token here; the decode side continues (and handles stop strings and min_tokens).
            once = dataclasses.replace(job.params, max_tokens=1, min_tokens=min(job.params.min_tokens, 1), stop=None)
            job.seq = self.engines[d].add_request(job.token_ids, once, request_id=job.request_id, hold_kv=True)
        except (ValueError, TypeError) as e:
            job.resolve(error=ValueError(str(e)))
            return
        job.replica = d
        job.started = time.monotonic()
        self.jobs[job.request_id] = job

    def _cost(self, d: int) -> tuple[int, int]:
        r = self._load[d]
        return (r.queued_prefill_tokens, d)

    def _finished(self, d: int, seq: Sequence) -> None:
        job = self.jobs.pop(seq.request_id, None)
        eng = self.engines[d]
        if job is None:  # aborted meanwhile
            eng.release(seq.request_id)
            return
        if seq.finish_reason == "abort" or not seq.output_token_ids:
            eng.release(seq.request_id)
            self._answers.append(lambda: job.resolve(error=Aborted(seq.request_id)))
            return
        token = seq.output_token_ids[0]
        want_lp = job.params.logprobs is not None
        first = token_pb(token, seq.logprobs[0] if want_lp else math.nan,
                         seq.top_logprobs[0] if want_lp and seq.top_logprobs else None)
        reason = ""
        if seq.finish_reason == "stop":
            reason = "stop"
        elif (job.params.max_tokens or 0) <= 1 or len(seq.prompt_token_ids) + 1 >= self.max_model_len:
            reason = "length"
        now = time.monotonic()
        started = job.started or now
        resp = pb.PrefillResponse(request_id=seq.request_id, dp_rank=d, first_token=first, finish_reason=reason,
                                  queue_s=started - job.arrived, prefill_s=now - started)
        if reason:
            eng.release(seq.request_id)
        else:
            held = eng.held[seq.request_id]
            self.held_on[seq.request_id] = d
            self.leases.hold(seq.request_id)
            resp.kv.CopyFrom(to_handle(
                eng.kv_ownership(seq.request_id), len(held.block_ids), self.layouts, node_id=self.config.node_id,
                address=self.address, dp_rank=d, block_size=self.block_size, lease_s=self.config.lease_s,
            ))
        self._answers.append(lambda: job.resolve(resp))

    def _release_held(self, request_id: str) -> bool:
        d = self.held_on.pop(request_id, None)
        return d is not None and self.engines[d].release(request_id)

    def _abort(self, request_id: str, why: Exception | None = None) -> bool:
        if self.leases.abort(request_id):
            return True
        job = self.jobs.pop(request_id, None)
        if job is None:
            return False
        self.engines[job.replica].abort(request_id)
        error = why or Aborted(request_id)
        self._answers.append(lambda: job.resolve(error=error))
        return True

    def _publish_load(self) -> None:
        out = []
        for d, e in enumerate(self.engines):
            s = e.scheduler
            queued = sum(q.num_remaining for q in list(s.waiting) + list(s.running))
            out.append(ReplicaLoad(dp_rank=d, queued_prefill_tokens=queued, waiting=len(s.waiting),
                                   running=len(s.running), used_blocks=e.num_used_blocks,
                                   free_blocks=s.allocator.num_free))
        self._load = out

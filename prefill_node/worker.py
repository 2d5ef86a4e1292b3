"""The prefill node's engine side: DP replicas of PCP x PP ranks, stepped on one thread.

Request lifecycle here:

1. ``submit`` queues a prefill (from the gRPC handler's event loop); the engine thread adds it to
   its replica with ``hold_kv`` and a one-token budget, and steps every busy replica together
   (launch all, then collect: replicas compute concurrently).
2. When the first token is sampled the request finishes with its KV blocks kept. If that token
   ends the request (a stop token, or ``max_tokens`` 1) the blocks are freed at once; otherwise
   they are held under a lease and the answer carries the KV handle: which rank holds which block
   and where each rank's registered cache is.
3. ``release`` (the decode side has the KV), ``abort``, or the lease running out frees them. A
   release is answered at once, even while the engine is in a long prefill step: its lease ends on
   the caller's thread (``KVSender.take``) and the blocks are freed between two steps.

Every engine call happens on the engine thread (``node_runtime.engine_loop``); other threads send
it ``node_runtime.commands`` (``Start`` with a ``PrefillJob``, ``Abort``, ``Release``, ``AbortAll``).
The sender side of the KV hand-off is ``kv_transfer.handoff.KVSender``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cluster.config import NodeConfig
from cluster.nodes import ReplicaLoad
from cluster.proto_gen import pdcluster_v1_pb2 as pb
from cluster.wire import token_pb
from engine.fp8_compute import weights_held
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from kv_transfer.handle import to_handle
from kv_transfer.handoff import KVSender
from kv_transfer.layout import CacheLayout
from kv_transfer.protocol import choose_protocol
from kv_transfer.transports.mooncake import MooncakeExporter
from node_runtime.commands import Abort, AbortAll, Release, Start
from node_runtime.engine_loop import EngineLoop
from node_runtime.replica_load import replica_load

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


class PrefillWorker(EngineLoop):
    def __init__(self, config: NodeConfig, transfer_host: str) -> None:
        super().__init__("prefill-engine")
        self.config = config
        ec = config.engine
        # Every rank (or this process, at world size 1) registers its cache with Mooncake on the
        # advertised host; the rendezvous of the ranks uses that host too. At world size 1 on a GPU the
        # engine captures CUDA graphs of token rows: short prompts prefill as one replay.
        ec = dataclasses.replace(ec, dist_host=transfer_host)
        self.kv_protocol = choose_protocol(config.kv_protocol, ec.torch_device().type == "cuda", transfer_host)
        log.info("KV transport: Mooncake %s on %s", self.kv_protocol, transfer_host)
        self.llm = LLM.from_config(ec, MooncakeExporter(transfer_host, self.kv_protocol))
        self.layouts: dict[int, CacheLayout] = {r: _layout(x) for r, x in self.llm.cache_exports.items()}
        self.engines: list[LLMEngine] = self.llm.engines
        self.max_model_len = self.engines[0].max_model_len
        self.num_blocks = self.engines[0].load().free_blocks
        self.block_size = ec.block_size
        mc = self.engines[0].model_config
        kv_format = ec.kv_format(mc)
        self.kv_cache_dtype = kv_format.wire_name
        self.weights = weights_held(mc.quantization is not None, ec.torch_dtype(mc.torch_dtype), ec.torch_device())
        log.info("KV cache: %s", kv_format.describe())
        self.prefix_caching = ec.enable_prefix_caching
        self.routed_experts = mc.n_routed_experts or 0
        self.address = ""  # set once the server listens (goes into KV handles)
        self.leases = KVSender(self._release_held, lease_s=config.lease_s)
        self.held_on: dict[str, int] = {}  # request id -> replica holding its blocks
        self.jobs: dict[str, PrefillJob] = {}  # submitted, not answered
        self.failed = threading.Event()
        self.failure: str | None = None
        self._load = [ReplicaLoad(dp_rank=d, free_blocks=self.num_blocks) for d in range(len(self.engines))]
        self.start()

    # -- called from other threads -------------------------------------------------------------
    def submit(self, job: PrefillJob) -> None:
        self.send(Start(job))

    def abort(self, request_id: str, done: Callable[[bool], None] | None = None) -> None:
        """Free whatever the request holds (queued, prefilling, or held under a lease); ``done(found)``
        is called from the engine thread once it is free."""
        self.send(Abort(request_id, done))

    def release(self, request_id: str, done: Callable[[bool], None]) -> None:
        """The decode side has the KV: ``done(found)`` at once, from this thread (not after the step the
        engine is in, which for a long prompt takes a prefill's time); the blocks are freed between
        two steps. ``found`` is False when the lease had already ended (expired or aborted)."""
        found = self.leases.take(request_id)
        if found:
            self.send(Release(request_id))
        done(found)

    def load(self) -> list[ReplicaLoad]:
        return list(self._load)

    def take_kv_events(self) -> list[tuple[int, list[int], list[int]]]:
        return [(d, *e.take_kv_events()) for d, e in enumerate(self.engines)]

    def in_flight(self) -> int:
        return len(self.jobs) + len(self.leases)

    def abort_all(self, why: str) -> None:
        self.send(AbortAll(why))

    def shutdown(self) -> None:
        self.stop()
        self.llm.shutdown()

    def stats(self) -> tuple[list[pb.ReplicaStats], pb.TransferTotals]:
        reps = [pb.ReplicaStats(dp_rank=r.dp_rank, waiting=r.waiting, running=r.running,
                                queued_prefill_tokens=r.queued_prefill_tokens, used_blocks=r.used_blocks,
                                free_blocks=r.free_blocks, held=self._held_count(r.dp_rank)) for r in self._load]
        return reps, self.transfer_totals()

    def transfer_totals(self) -> pb.TransferTotals:
        """The prefill side's: leases that ran out (the decode side reports the pulls)."""
        return pb.TransferTotals(leases_expired=self.leases.expired_total)

    def _held_count(self, d: int) -> int:
        return sum(1 for v in list(self.held_on.values()) if v == d)

    # -- the engine thread ---------------------------------------------------------------------
    def handle(self, message: object) -> None:
        match message:
            case Start(job):
                self._start(job)
            case Abort(rid, done):
                found = self._abort(rid)
                if done is not None:
                    self.answer(functools.partial(done, found))
            case Release(rid):
                self._release_held(rid)
            case AbortAll(why):
                for rid in list(self.jobs) + list(self.held_on):
                    self._abort(rid, NodeFailed(f"aborted: {why}"))
            case _:
                raise TypeError(f"unknown message {message!r}")

    def step(self) -> int:
        self.leases.expire()
        busy = [(self.engines.index(e), e) for e in self.llm.to_step()]
        scheduled = 0
        for _, e in busy:  # replicas compute concurrently: launch all, then collect
            scheduled += e.launch_step()
        finished = [(d, e.finish_step()) for d, e in busy]
        for _, e in busy:  # (EP across DP on rank processes: every replica's MTP pass asked for first, then the
            e.settle_drafts()  # drafts the held requests hand off)
        for d, seqs in finished:
            for seq in seqs:
                self._finished(d, seq)
        return scheduled

    def on_failure(self, error: BaseException) -> None:
        self.failure = f"{type(error).__name__}: {error}"
        self.failed.set()
        for job in list(self.jobs.values()):
            job.resolve(error=NodeFailed(self.failure))
        self.jobs.clear()

    def _start(self, job: PrefillJob) -> None:
        if self.stopping or self.failed.is_set():
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
            self.answer(lambda: job.resolve(error=Aborted(seq.request_id)))
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
                                  queue_s=started - job.arrived, prefill_s=now - started,
                                  cached_tokens=seq.prefix_hit_blocks * eng.config.block_size)
        if job.params.prompt_logprobs is not None:  # echo: every prompt token, its logprob and top-N
            resp.prompt_tokens.extend(
                token_pb(t, lp, top) for t, lp, top in zip(seq.prompt_token_ids, seq.prompt_logprobs,
                                                           seq.prompt_top_logprobs))
        if reason:
            eng.release(seq.request_id)
        else:
            resp.mtp_drafts.extend(seq.drafts)  # speculative decoding: verified at the decode side's first step
            held = eng.held_kv(seq.request_id)
            self.held_on[seq.request_id] = d
            self.leases.hold(seq.request_id)
            resp.kv.CopyFrom(to_handle(
                held.ranks, held.num_blocks, self.layouts, node_id=self.config.node_id,
                address=self.address, dp_rank=d, block_size=self.block_size, lease_s=self.config.lease_s,
                kv_format=self.kv_cache_dtype,
            ))
        self.answer(lambda: job.resolve(resp))

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
        self.answer(lambda: job.resolve(error=error))
        return True

    def publish(self) -> None:
        self._load = [replica_load(d, e.load()) for d, e in enumerate(self.engines)]

def _layout(export: object) -> CacheLayout:
    if not isinstance(export, CacheLayout):
        raise TypeError(f"a rank's cache was not registered (got {export!r})")
    return export
